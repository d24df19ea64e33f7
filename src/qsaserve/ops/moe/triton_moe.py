"""Routed experts for a few tokens (decode) reading each chosen expert's weights in place.

The torch path (`reference.moe_experts_sync_free`) gathers the k chosen
experts' [2I, H] and [H, I] matrices into new tensors and runs batched matmuls: every active weight
byte is read, written and read again, in ~12 launches. Here two kernels (and one for the router:
softmax, top-k and renormalisation, `moe_route_triton`):

  _gate_up_kernel: one program per (token, choice, block of I): gate and up rows of expert
                   indices[t, j] against x[t] -> silu(gate) * up, rounded as torch rounds each op;
  _down_kernel:    one program per (token, block of H): for each of the token's k choices,
                   down_e @ act, times its routing weight, summed over the choices (one
                   pipelined loop over (choice, K tile), the choices loaded up front).

Both take block-FP8 experts too (FP8: E4M3 weights, 1 byte a weight read, and 128 x 128 block
scales): each GEMM's input is rounded to E4M3 per token and group of 128 channels in registers, as
the block-FP8 GEMM quantizes it, and the group's scale times the weight block's scale is folded
into it, so the FMAs run on the E4M3 weights widened to float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.device import num_sms
from qsaserve.ops.moe.triton_grouped import _quantize_group


@triton.jit
def _fp8_group_input(v, BLOCK_K: tl.constexpr):
    """v [BLOCK_K] float32 (whole groups of 128 channels) -> (q [G, 128] float32, scale [G]): the
    grouped GEMMs' activation quantization (triton_grouped._quantize_group), its E4M3 values widened."""
    q, scale = _quantize_group(tl.reshape(v, (BLOCK_K // 128, 128)))
    return q.to(tl.float32), scale


@triton.jit
def _fp8_scaled(q, scale, ws_ptr, k0, K, stride_sk, BLOCK_K: tl.constexpr):
    """_fp8_group_input's groups times their scale and the weight block scales ws_ptr[g * stride_sk]
    of the groups (one 128-row block of weights) -> [BLOCK_K] float32, what multiplies the E4M3
    weights of columns k0 .. k0 + BLOCK_K."""
    g = k0 // 128 + tl.arange(0, BLOCK_K // 128)
    ws = tl.load(ws_ptr + g * stride_sk, mask=g * 128 < K, other=0.0)
    return tl.reshape(q * (scale * ws)[:, None], (BLOCK_K,))


@triton.jit
def _gate_up_kernel(x_ptr, idx_ptr, w_ptr, act_ptr, s_ptr, H, I, K,
                    stride_x, stride_we, stride_wn, stride_a, stride_se, stride_sn, stride_sk,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr = False,
                    NUM_STAGES: tl.constexpr = 1):
    r = tl.program_id(0)  # (token, choice) = (r // K, r % K)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < I
    e = tl.load(idx_ptr + r).to(tl.int64)
    x_row = x_ptr + (r // K).to(tl.int64) * stride_x
    w_gate = w_ptr + e * stride_we + n[:, None] * stride_wn
    w_up = w_gate + I * stride_wn
    # block FP8: the program's gate rows lie in one 128-row scale block, so do its up rows
    s_gate = s_ptr + e * stride_se + (n0 // 128) * stride_sn
    s_up = s_ptr + e * stride_se + ((I + n0) // 128) * stride_sn
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):  # stages: later tiles' loads in flight
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < H
        xv = tl.load(x_row + k, mask=k_ok, other=0.0).to(tl.float32)
        x_g = xv
        x_u = xv
        if FP8:  # W8A8: x rounded per token and 128-group, both scales folded into it
            q, scale = _fp8_group_input(xv, BLOCK_K)
            x_g = _fp8_scaled(q, scale, s_gate, k0, H, stride_sk, BLOCK_K)
            x_u = _fp8_scaled(q, scale, s_up, k0, H, stride_sk, BLOCK_K)
        m = n_ok[:, None] & k_ok[None, :]
        acc_g += tl.sum(tl.load(w_gate + k[None, :], mask=m, other=0.0).to(tl.float32) * x_g[None, :], 1)
        acc_u += tl.sum(tl.load(w_up + k[None, :], mask=m, other=0.0).to(tl.float32) * x_u[None, :], 1)
    dt = act_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
    tl.store(act_ptr + r.to(tl.int64) * stride_a + n, (silu * acc_u.to(dt).to(tl.float32)).to(dt), mask=n_ok)


@triton.jit
def _down_kernel(act_ptr, idx_ptr, rw_ptr, w_ptr, out_ptr, s_ptr, H, I, K,
                 stride_a, stride_we, stride_wn, stride_o, stride_se, stride_sn, stride_sk,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr = False,
                 NUM_STAGES: tl.constexpr = 1, K_POW2: tl.constexpr = 16):
    t = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < H
    dt = out_ptr.dtype.element_ty
    # the token's choices and routing weights up front: the loop's weight addresses then depend on
    # no load inside it, and one loop over (choice, K tile) keeps the next experts' tiles in flight
    jj = tl.arange(0, K_POW2)
    experts = tl.load(idx_ptr + t * K + jj, mask=jj < K, other=0).to(tl.int64)
    weights = tl.load(rw_ptr + t * K + jj, mask=jj < K, other=0.0).to(tl.float32)
    n_k = tl.cdiv(I, BLOCK_K)
    total = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for it in tl.range(0, K * n_k, num_stages=NUM_STAGES):
        j = it // n_k
        k0 = (it - j * n_k) * BLOCK_K
        r = t * K + j
        e = tl.sum(tl.where(jj == j, experts, 0), 0)
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < I
        a = tl.load(act_ptr + r.to(tl.int64) * stride_a + k, mask=k_ok, other=0.0).to(tl.float32)
        if FP8:
            q, scale = _fp8_group_input(a, BLOCK_K)
            a = _fp8_scaled(q, scale, s_ptr + e * stride_se + (n0 // 128) * stride_sn, k0, I, stride_sk, BLOCK_K)
        wv = tl.load(w_ptr + e * stride_we + n[:, None] * stride_wn + k[None, :],
                     mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wv * a[None, :], 1)
        if k0 + BLOCK_K >= I:  # choice j done: y_j, then y_j * weight, in dt
            rw = tl.sum(tl.where(jj == j, weights, 0.0), 0)
            total += (acc.to(dt).to(tl.float32) * rw).to(dt).to(tl.float32)
            acc = tl.zeros([BLOCK_N], tl.float32)
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
# Columns an iteration and the software pipeline of both kernels: short K tiles with the next
# ones loading (the plain GEMV's best shape on an H200 for outputs of this width over K 2,048:
# ops/gemv, gemv_decode_h200_2026-12-04_3d5bcb1.json); until 6cdf8dc 512 columns, 4 warps, no
# pipeline (2.14 TB/s at qwen4exp-small's batch 1). bench_moe.py times both.
GATE_UP_BLOCK_K, DOWN_BLOCK_K = 256, 512
DECODE_STAGES, DECODE_WARPS = 3, 2


def pick_block_n(rows: int, width: int, sms: int) -> int:
    """The widest row block whose grid (rows x width / block) has PROGRAMS_PER_SM programs per SM."""
    for bn in BLOCK_N_CHOICES:
        if rows * triton.cdiv(width, bn) >= PROGRAMS_PER_SM * sms:
            return bn
    return BLOCK_N_CHOICES[-1]


def moe_experts_decode_triton(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                              gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                              block_n: tuple[int, int] | None = None, w13_scale: torch.Tensor | None = None,
                              w2_scale: torch.Tensor | None = None, block_k: tuple[int, int] | None = None,
                              num_stages: int = DECODE_STAGES, num_warps: int = DECODE_WARPS) -> torch.Tensor:
    """x [N, H], indices / weights [N, k], gate_up_proj [E, 2I, H], down_proj [E, H, I] -> [N, H]
    (SiLU experts), as moe_experts_sync_free. block_n: (gate/up, down) row blocks (default: by
    pick_block_n); block_k: (gate/up, down) columns an iteration (default GATE_UP_BLOCK_K and
    DOWN_BLOCK_K, at most the next power of two of H / I); num_stages / num_warps of both kernels
    (benchmarks/bench_moe.py compares others). Block-FP8 experts (takes_fp8): E4M3 weights with
    w13_scale [E, 2I/128, H/128] and w2_scale [E, H/128, I/128]; each GEMM's input is rounded per
    token and 128-group as the block-FP8 GEMM's (block_fp8.moe_experts_block_fp8), its products
    summed in float32 by FMAs, 1 byte a weight read."""
    n, k = indices.shape
    h = x.shape[1]
    inter = down_proj.shape[2]
    if gate_up_proj.stride(-1) != 1 or down_proj.stride(-1) != 1:
        raise ValueError("gate_up_proj, down_proj: the last dimension must be contiguous")
    fp8 = w13_scale is not None
    if fp8 and not takes_fp8(h, inter):
        raise ValueError(f"block-FP8 experts in the decode kernels: H {h} and I {inter} must be multiples of 128")
    x = x.contiguous()
    idx = indices.contiguous()
    rw = weights.contiguous()
    act = torch.empty((n * k, inter), dtype=x.dtype, device=x.device)
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    sms = num_sms(x.device)
    bn_gu, bn_down = block_n or (pick_block_n(n * k, inter, sms), pick_block_n(n, h, sms))
    s13 = w13_scale if fp8 else gate_up_proj  # unread without FP8
    s2 = w2_scale if fp8 else down_proj
    st13 = (s13.stride(0), s13.stride(1), s13.stride(2)) if fp8 else (0, 0, 0)
    st2 = (s2.stride(0), s2.stride(1), s2.stride(2)) if fp8 else (0, 0, 0)
    bk_gu, bk_down = block_k or (GATE_UP_BLOCK_K, DOWN_BLOCK_K)
    bk_gu, bk_down = min(bk_gu, triton.next_power_of_2(h)), min(bk_down, triton.next_power_of_2(inter))
    if fp8 and (bk_gu % 128 or bk_down % 128):
        raise ValueError(f"block_k: multiples of 128 for block-FP8 experts, got {(bk_gu, bk_down)}")
    _gate_up_kernel[(n * k, triton.cdiv(inter, bn_gu))](
        x, idx, gate_up_proj, act, s13, h, inter, k, x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1),
        act.stride(0), *st13, BLOCK_N=bn_gu, BLOCK_K=bk_gu, FP8=fp8, NUM_STAGES=num_stages, num_warps=num_warps)
    _down_kernel[(n, triton.cdiv(h, bn_down))](
        act, idx, rw, down_proj, out, s2, h, inter, k, act.stride(0), down_proj.stride(0), down_proj.stride(1),
        out.stride(0), *st2, BLOCK_N=bn_down, BLOCK_K=bk_down, FP8=fp8, NUM_STAGES=num_stages,
        K_POW2=triton.next_power_of_2(k), num_warps=num_warps)
    return out


def takes_fp8(hidden: int, inter: int) -> bool:
    """Whether block-FP8 experts of this shape run in the decode kernels: whole 128-channel groups
    on both GEMMs' inputs (and so whole scale blocks under every row block)."""
    return hidden % 128 == 0 and inter % 128 == 0
