"""Routed experts for a few tokens (decode) reading each chosen expert's weights in place.

The torch path (`reference.moe_experts_sync_free`) gathers the k chosen
experts' [2I, H] and [H, I] matrices into new tensors and runs batched matmuls: every active weight
byte is read, written and read again, in ~12 launches. Here two kernels (and one for the router:
softmax, top-k and renormalisation, `moe_route_triton`):

  _gate_up_kernel: one program per (token, choice, block of I): gate and up rows of expert
                   indices[t, j] against x[t] -> silu(gate) * up, rounded as torch rounds each op;
  _down_kernel:    one program per (token, block of H): for each of the token's k choices,
                   down_e @ act, times its routing weight, summed over the choices.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.device import num_sms


@triton.jit
def _gate_up_kernel(x_ptr, idx_ptr, w_ptr, act_ptr, H, I, K,
                    stride_x, stride_we, stride_wn, stride_a,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    r = tl.program_id(0)  # (token, choice) = (r // K, r % K)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    e = tl.load(idx_ptr + r).to(tl.int64)
    x_row = x_ptr + (r // K).to(tl.int64) * stride_x
    w_gate = w_ptr + e * stride_we + n[:, None] * stride_wn
    w_up = w_gate + I * stride_wn
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        xv = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        m = n_ok[:, None] & k_ok[None, :]
        acc_g += tl.sum(tl.load(w_gate + k[None, :], mask=m, other=0.0).to(tl.float32) * xv[None, :], 1)
        acc_u += tl.sum(tl.load(w_up + k[None, :], mask=m, other=0.0).to(tl.float32) * xv[None, :], 1)
    dt = act_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
    tl.store(act_ptr + r.to(tl.int64) * stride_a + n, (silu * acc_u.to(dt).to(tl.float32)).to(dt), mask=n_ok)


@triton.jit
def _down_kernel(act_ptr, idx_ptr, rw_ptr, w_ptr, out_ptr, H, I, K,
                 stride_a, stride_we, stride_wn, stride_o,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    dt = out_ptr.dtype.element_ty
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in range(0, K):
        r = t * K + j
        e = tl.load(idx_ptr + r).to(tl.int64)
        rw = tl.load(rw_ptr + r).to(tl.float32)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < I
            a = tl.load(act_ptr + r.to(tl.int64) * stride_a + k, mask=k_ok, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + e * stride_we + n[:, None] * stride_wn + k[None, :],
                         mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(wv * a[None, :], 1)
        total += (acc.to(dt).to(tl.float32) * rw).to(dt).to(tl.float32)  # y_j, then y_j * weight, in dt
    tl.store(out_ptr + t.to(tl.int64) * stride_o + n, total.to(dt), mask=n_ok)


@triton.jit(do_not_specialize=["stride_l"])  # logits are a view of the MoE block's packed GEMM: the warm-up's differ
def _route_kernel(logits_ptr, w_ptr, i_ptr, E, stride_l, stride_w, stride_i,
                  K: tl.constexpr, K_POW2: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr):
    """One token: fp32 softmax over its E router logits, the top K by repeated argmax (the lowest
    expert on an exact tie), optionally renormalised to sum 1, weights cast to the logits dtype."""
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    logits = tl.load(logits_ptr + row * stride_l + e, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 0))
    p = tl.where(ok, p / tl.sum(tl.where(ok, p, 0.0), 0), -1.0)  # -1: never chosen
    j = tl.arange(0, K_POW2)
    weights = tl.zeros([K_POW2], tl.float32)
    chosen = tl.zeros([K_POW2], tl.int64)
    for r in tl.static_range(K):
        best = tl.max(p, 0)
        pick = tl.minimum(tl.min(tl.where(p == best, e, BLOCK_E), 0), E - 1)  # in range even for NaN logits
        weights = tl.where(j == r, best, weights)
        chosen = tl.where(j == r, pick.to(tl.int64), chosen)
        p = tl.where(e == pick, -1.0, p)
    if NORM:
        weights = weights / tl.sum(weights, 0)
    tl.store(w_ptr + row * stride_w + j, weights.to(w_ptr.dtype.element_ty), mask=j < K)
    tl.store(i_ptr + row * stride_i + j, chosen, mask=j < K)


def moe_route_triton(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] -> (weights [N, k] in the logits' dtype, expert indices [N, k]), as
    ops.moe.reference.moe_route (softmax, topk, renormalise: ~6 launches) in one."""
    n, e = logits.shape
    if not 0 < top_k <= e:
        raise ValueError(f"top_k: must be in [1, {e}], got {top_k}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((n, top_k), dtype=logits.dtype, device=logits.device)
    indices = torch.empty((n, top_k), dtype=torch.int64, device=logits.device)
    if n:
        _route_kernel[(n,)](logits, weights, indices, e, logits.stride(0), weights.stride(0), indices.stride(0),
                            K=top_k, K_POW2=triton.next_power_of_2(top_k), NORM=bool(norm_topk_prob),
                            BLOCK_E=triton.next_power_of_2(e), num_warps=1 if e <= 256 else 4)
    return weights, indices


# Row-block sizes tried, widest first. At qwen4exp-small's batch 1 (8 choices, I 512, H 2048)
# 16-row blocks give ~1 program per SM, too few loads in flight to read the weights at speed
# (docs/benchmarks.md, "Kernel launch choices"); narrower blocks until the grid has a few programs
# per SM keep more loads in flight.
BLOCK_N_CHOICES = (32, 16, 8, 4)
PROGRAMS_PER_SM = 4


def pick_block_n(rows: int, width: int, sms: int) -> int:
    """The widest row block whose grid (rows x width / block) has PROGRAMS_PER_SM programs per SM."""
    for bn in BLOCK_N_CHOICES:
        if rows * triton.cdiv(width, bn) >= PROGRAMS_PER_SM * sms:
            return bn
    return BLOCK_N_CHOICES[-1]


def moe_experts_decode_triton(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                              gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                              block_n: tuple[int, int] | None = None) -> torch.Tensor:
    """x [N, H], indices / weights [N, k], gate_up_proj [E, 2I, H], down_proj [E, H, I] -> [N, H]
    (SiLU experts), as moe_experts_sync_free. block_n: (gate/up, down) row blocks (default: by
    pick_block_n; the benchmark compares others)."""
    n, k = indices.shape
    h = x.shape[1]
    inter = down_proj.shape[2]
    if gate_up_proj.stride(-1) != 1 or down_proj.stride(-1) != 1:
        raise ValueError("gate_up_proj, down_proj: the last dimension must be contiguous")
    x = x.contiguous()
    idx = indices.contiguous()
    rw = weights.contiguous()
    act = torch.empty((n * k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    sms = num_sms(x.device)
    bn_gu, bn_down = block_n or (pick_block_n(n * k, inter, sms), pick_block_n(n, h, sms))
    _gate_up_kernel[(n * k, triton.cdiv(inter, bn_gu))](
        x, idx, gate_up_proj, act, h, inter, k, x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1),
        act.stride(0), BLOCK_N=bn_gu, BLOCK_K=min(512, triton.next_power_of_2(h)), num_warps=4)
    _down_kernel[(n, triton.cdiv(h, bn_down))](
        act, idx, rw, down_proj, out, h, inter, k, act.stride(0), down_proj.stride(0), down_proj.stride(1),
        out.stride(0), BLOCK_N=bn_down, BLOCK_K=min(512, triton.next_power_of_2(inter)), num_warps=4)
    return out
