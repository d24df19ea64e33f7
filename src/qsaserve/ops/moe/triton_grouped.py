"""Routed experts as grouped GEMMs over (expert, block of token-choices), without host syncs.

The torch loop (`reference.moe_experts`) reads the routing back to the host and runs two GEMMs
per expert present (E nonzero + synchronize per layer). Here, for any number of tokens:

  sort:      torch.sort (stable) of the flat expert ids, torch.searchsorted for each expert's
             first row, then _align_kernel: one program per BLOCK_M block of the padded order
             writes the block's expert and its token-choice ids (moe_align_block_size's idea;
             the grid is a static bound, grouped_config.max_blocks, so nothing is read back);
  gate/up:   _grouped_gate_up_kernel, one program per (block, I tile): x rows of the block's token-choices
             against the expert's gate and up tiles, SiLU(gate) * up in the epilogue -> [N*k, I];
  down:      _grouped_down_kernel, one program per (block, H tile): act rows against the expert's down
             tile, times the routing weight in the epilogue -> [N, k, H];
  top-k sum: one torch sum over k. Each output row is written once, by the one program owning its
             token-choice, and summed in a fixed order: the result is the same on every run,
             which float atomics adding the k choices into [N, H] would not give.

Blocks past the used ones (expert id -1) return at once. Rounding follows the torch path: each
GEMM's output, SiLU, the product and the weighted row are rounded to the activation dtype.

Weight formats (constexpr FMT): the model dtype; block FP8 (W8A8: E4M3 weights, float32 128 x 128
block scales, the activations quantized per token and 128-channel group as they load; float32
models multiply the E4M3 values on fp16 MMAs, fp8_gemm.triton_gemm.e4m3_dot); NVFP4 as
W4A16 (ops/moe/nvfp4.py's layout: packed E2M1 weights decoded in the load path, times their E4M3
per-16 scales, in the activation dtype, which holds each E2M1 x E4M3 product exactly; the
per-row global scale applied once to the float32 sums; bf16 tensor-core dots, Marlin's idea).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.device import num_sms
from qsaserve.ops.fp8_gemm.triton_gemm import e4m3_dot
from qsaserve.ops.moe.grouped_config import FP8_BLOCK_K, GroupedConfig, max_blocks, step_configs
from qsaserve.ops.nvfp4_gemm.reference import GROUP as NVFP4_GROUP
from qsaserve.ops.nvfp4_gemm.triton_gemv import e2m1_bits, scaled_e2m1, sums_factor

MODEL_DTYPE, FP8, NVFP4 = 0, 1, 2  # the kernels' FMT: weight formats


@triton.jit(do_not_specialize=["num_choices"])
def _align_kernel(order_ptr, starts_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, num_choices, E,
                  E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    b = tl.program_id(0)
    e = tl.arange(0, E_POW2)
    ok = e < E
    lo = tl.load(starts_ptr + e, mask=ok, other=0).to(tl.int32)
    hi = tl.load(starts_ptr + e + 1, mask=ok, other=0).to(tl.int32)
    count = hi - lo
    blocks = (count + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, 0)
    block_start = block_end - blocks
    tl.store(num_padded_ptr + e * 0, tl.sum(blocks, 0) * BLOCK_M + e * 0, mask=(e == 0) & (b == 0))
    mine = ok & (block_start <= b) & (b < block_end)
    expert = tl.max(tl.where(mine, e, -1), 0)
    first = tl.sum(tl.where(mine, lo, 0), 0)
    rows = tl.sum(tl.where(mine, count, 0), 0)
    r = (b - tl.sum(tl.where(mine, block_start, 0), 0)) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = r < rows  # rows is 0 for an unused block
    ids = tl.load(order_ptr + first + r, mask=valid, other=0).to(tl.int32)
    tl.store(sorted_ids_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M), tl.where(valid, ids, num_choices))
    tl.store(expert_ids_ptr + b, expert)


@triton.jit
def _quantize_group(a):
    """a [BLOCK_M, 128] (one group of 128 channels per row) -> (E4M3 a / scale, float32 scale
    [BLOCK_M]), scale = max(|a|, 1e-10) / 448 per row, as block_fp8.quantize_groups."""
    af = a.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(af), 1), 1e-10) / 448.0
    q = tl.clamp(af / scale[:, None], -448.0, 448.0).to(tl.float8e4nv)
    return q, scale


@triton.jit
def _nvfp4_tile(w_ptr, s_ptr, n, n_ok, k0, K, stride_wn, stride_sn, dtype: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """Columns k0 .. k0 + BLOCK_K of rows n of one NVFP4 expert matrix (w_ptr, s_ptr at the
    expert: packed uint8 [N, K/2], E4M3 scales [N, K/16]) -> [BLOCK_K, BLOCK_N] in dtype: each
    E2M1 code decoded by bit arithmetic (the even column from the low nibble; nvfp4_gemm's
    e2m1_bits, e2m1 * 2^-126) and times its group's scale and 2^63 (nvfp4_gemm's sums_factor undoes
    it; fp16, 5 exponent bits, takes 2^126 then the scale instead), a product every dtype holds
    exactly (2 x 4 significant bits, a normal float); the row's global scale is left to the
    caller. Masked rows and columns past K read 0."""
    half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    group = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    rows = n[:, None].to(tl.int64)
    packed = tl.load(w_ptr + rows * stride_wn + half[None, :], mask=n_ok[:, None] & (half < K // 2)[None, :], other=0)
    w = tl.reshape(tl.join(e2m1_bits(packed & 0xF), e2m1_bits(packed >> 4)), (BLOCK_N, BLOCK_K))  # [n, k]
    s = tl.load(s_ptr + rows * stride_sn + group[None, :], mask=n_ok[:, None] & (group < K // GROUP)[None, :],
                other=0.0).to(tl.float32)
    w = scaled_e2m1(tl.reshape(w, (BLOCK_N, BLOCK_K // GROUP, GROUP)), s, dtype == tl.float16)
    return tl.trans(tl.reshape(w, (BLOCK_N, BLOCK_K)).to(dtype))


@triton.jit
def _block_choices(sorted_ids_ptr, expert_ids_ptr, num_choices, BLOCK_M: tl.constexpr):
    """This program's block of the aligned order -> (its expert, -1 for an unused block; its
    token-choice ids [BLOCK_M]; which of them are real, not padding)."""
    b = tl.program_id(0)
    e = tl.load(expert_ids_ptr + b).to(tl.int64)
    rows = tl.load(sorted_ids_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
    return e, rows, rows < num_choices


@triton.jit(do_not_specialize=["num_choices"])
def _grouped_gate_up_kernel(x_ptr, w_ptr, ws_ptr, wr_ptr, act_ptr, sorted_ids_ptr, expert_ids_ptr, num_choices, H, I,
                            top_k, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_re, stride_a,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                            FMT: tl.constexpr):
    e, rows, valid = _block_choices(sorted_ids_ptr, expert_ids_ptr, num_choices, BLOCK_M)
    if e < 0:
        return
    tok = (rows // top_k).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_x + k[None, :]
    g_ptrs = w_ptr + e * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]  # [BLOCK_K, BLOCK_N]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = k + k0 < H
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        if FMT == 2:  # NVFP4: [E, 2I, H/2] codes, [E, 2I, H/16] scales
            wg = _nvfp4_tile(w_ptr + e * stride_we, ws_ptr + e * stride_se, n, n_ok, k0, H, stride_wn, stride_sn,
                             a.dtype, BLOCK_N, BLOCK_K, 16)
            wu = _nvfp4_tile(w_ptr + e * stride_we + I * stride_wn, ws_ptr + e * stride_se + I * stride_sn, n, n_ok,
                             k0, H, stride_wn, stride_sn, a.dtype, BLOCK_N, BLOCK_K, 16)
            if IEEE:
                acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
                acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, wg, acc_g)
                acc_u = tl.dot(a, wu, acc_u)
        else:
            wg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FMT == 1:  # block FP8, BLOCK_K == 128: one activation group and one weight block column per step
                aq, a_scale = _quantize_group(a)
                s_ptrs = ws_ptr + e * stride_se + k0 // BLOCK_K
                sg = tl.load(s_ptrs + (n // BLOCK_K) * stride_sn, mask=n_ok, other=0.0)
                su = tl.load(s_ptrs + ((n + I) // BLOCK_K) * stride_sn, mask=n_ok, other=0.0)
                acc_g += e4m3_dot(aq, wg, IEEE) * (a_scale[:, None] * sg[None, :])
                acc_u += e4m3_dot(aq, wu, IEEE) * (a_scale[:, None] * su[None, :])
            elif IEEE:
                acc_g = tl.dot(a, wg, acc_g, input_precision="ieee")
                acc_u = tl.dot(a, wu, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, wg, acc_g)
                acc_u = tl.dot(a, wu, acc_u)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if FMT == 2:  # the rows' global scales (gate's and up's own)
        f = sums_factor(x_ptr.dtype.element_ty == tl.float16)
        acc_g *= tl.load(wr_ptr + e * stride_re + n, mask=n_ok, other=0.0)[None, :] * f
        acc_u *= tl.load(wr_ptr + e * stride_re + I + n, mask=n_ok, other=0.0)[None, :] * f
    dt = act_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(dt).to(tl.float32)
    out = (silu * acc_u.to(dt).to(tl.float32)).to(dt)
    tl.store(act_ptr + rows[:, None].to(tl.int64) * stride_a + n[None, :], out, mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_choices"])
def _grouped_down_kernel(act_ptr, w_ptr, ws_ptr, wr_ptr, rw_ptr, y_ptr, sorted_ids_ptr, expert_ids_ptr, num_choices, H,
                         I, stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_re, stride_y,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                         FMT: tl.constexpr):
    e, rows, valid = _block_choices(sorted_ids_ptr, expert_ids_ptr, num_choices, BLOCK_M)
    if e < 0:
        return
    rows64 = rows.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows64[:, None] * stride_a + k[None, :]
    w_ptrs = w_ptr + e * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = k + k0 < I
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        if FMT == 2:  # NVFP4: [E, H, I/2] codes, [E, H, I/16] scales
            w = _nvfp4_tile(w_ptr + e * stride_we, ws_ptr + e * stride_se, n, n_ok, k0, I, stride_wn, stride_sn,
                            a.dtype, BLOCK_N, BLOCK_K, 16)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        else:
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FMT == 1:
                aq, a_scale = _quantize_group(a)
                ws = tl.load(ws_ptr + e * stride_se + (n // BLOCK_K) * stride_sn + k0 // BLOCK_K, mask=n_ok,
                             other=0.0)
                acc += e4m3_dot(aq, w, IEEE) * (a_scale[:, None] * ws[None, :])
            elif IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if FMT == 2:
        f = sums_factor(act_ptr.dtype.element_ty == tl.float16)
        acc *= tl.load(wr_ptr + e * stride_re + n, mask=n_ok, other=0.0)[None, :] * f
    dt = y_ptr.dtype.element_ty
    rw = tl.load(rw_ptr + rows64, mask=valid, other=0.0).to(tl.float32)
    y = (acc.to(dt).to(tl.float32) * rw[:, None]).to(dt)  # y_j, then y_j * weight, in dt
    tl.store(y_ptr + rows64[:, None] * stride_y + n[None, :], y, mask=valid[:, None] & n_ok[None, :])


def moe_align_block_size_triton(indices: torch.Tensor, num_experts: int, block_m: int,
                                num_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """indices [N, k] -> (sorted_ids [num_blocks * block_m], expert_ids [num_blocks], num_padded [1]),
    all int32, as ops.moe.reference.moe_align_block_size."""
    flat = indices.flatten()
    dev = flat.device
    sorted_e, order = torch.sort(flat.to(torch.int32), stable=True)
    starts = torch.searchsorted(sorted_e, torch.arange(num_experts + 1, dtype=torch.int32, device=dev), out_int32=True)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.zeros(1, dtype=torch.int32, device=dev)  # stays 0 without blocks
    if num_blocks:
        _align_kernel[(num_blocks,)](order, starts, sorted_ids, expert_ids, num_padded, flat.numel(), num_experts,
                                     E_POW2=triton.next_power_of_2(num_experts), BLOCK_M=block_m,
                                     num_warps=4 if num_experts > 256 else 1)
    return sorted_ids, expert_ids, num_padded


def moe_experts_grouped_triton(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                               gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                               configs: tuple[GroupedConfig, GroupedConfig] | None = None, *,
                               w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                               w13_row_scale: torch.Tensor | None = None,
                               w2_row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, H], indices / weights [N, k], gate_up_proj [E, 2I, H] (rows :I gate, I: up),
    down_proj [E, H, I] -> [N, H] (SiLU experts), as reference.moe_experts_sync_free.
    configs: (gate/up, down) tiles with the same block_m (default: grouped_config.step_configs).

    Block FP8 (w13_scale and w2_scale given): E4M3 weights with w13_scale [E, ceil(2I/128), ceil(H/128)]
    and w2_scale [E, ceil(H/128), ceil(I/128)] (float32 weight_scale_inv), the activations quantized
    per token-group of 128 as the kernels load them, as block_fp8.moe_experts_block_fp8.
    NVFP4 (the row scales given too): gate_up_proj uint8 [E, 2I, H/2], down_proj [E, H, I/2],
    w13_scale E4M3 [E, 2I, H/16], w2_scale [E, H, I/16], w13_row_scale float32 [E, 2I],
    w2_row_scale [E, H] (H and I multiples of 16), as nvfp4.moe_experts_nvfp4."""
    n, top_k = indices.shape
    fmt = _weight_format(gate_up_proj, down_proj, w13_scale, w2_scale, w13_row_scale, w2_row_scale)
    num_experts, two_i = gate_up_proj.shape[:2]
    h, inter = x.shape[1], two_i // 2
    if gate_up_proj.stride(-1) != 1 or down_proj.stride(-1) != 1:
        raise ValueError("gate_up_proj, down_proj: the last dimension must be contiguous")
    per_byte = 2 if fmt == NVFP4 else 1  # columns a stored element holds
    if gate_up_proj.shape[2] * per_byte != h:
        raise ValueError(f"gate_up_proj: expected {h // per_byte} columns for x of {h}, got {gate_up_proj.shape[2]}")
    if down_proj.shape != (num_experts, h, inter // per_byte):
        raise ValueError(f"down_proj: expected shape {(num_experts, h, inter // per_byte)}, got {tuple(down_proj.shape)}")
    if fmt == NVFP4:
        _check_nvfp4_scales(h, inter, w13_scale, w2_scale, w13_row_scale, w2_row_scale)
    choices = n * top_k
    cfg_gu, cfg_down = configs or step_configs(choices, num_experts, h, inter, x.element_size(),
                                                     num_sms(x.device), fp8=fmt == FP8)
    if fmt == FP8 and (cfg_gu.block_k != FP8_GROUP or cfg_down.block_k != FP8_GROUP):
        raise ValueError(f"configs: block-FP8 experts need block_k {FP8_GROUP} (the scale block)")
    if cfg_gu.block_m != cfg_down.block_m:
        raise ValueError(f"configs: both GEMMs must share block_m, got {cfg_gu.block_m} and {cfg_down.block_m}")
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    x = x.contiguous()
    rw = weights.to(x.dtype).contiguous().view(-1)
    bm = cfg_gu.block_m
    blocks = max_blocks(choices, num_experts, bm)
    sorted_ids, expert_ids, _ = moe_align_block_size_triton(indices, num_experts, bm, blocks)
    act = torch.empty((choices, inter), dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32  # float32 models: IEEE dots; FP8's E4M3 dots on fp16 MMAs (e4m3_dot)
    s13, s2 = (w13_scale, w2_scale) if fmt != MODEL_DTYPE else (gate_up_proj, down_proj)  # unread without scales
    r13, r2 = (w13_row_scale, w2_row_scale) if fmt == NVFP4 else (s13, s2)  # unread but for NVFP4

    def strides(t, used):
        return (t.stride(0), t.stride(1)) if used else (0, 0)

    _grouped_gate_up_kernel[(blocks, triton.cdiv(inter, cfg_gu.block_n))](
        x, gate_up_proj, s13, r13, act, sorted_ids, expert_ids, choices, h, inter, top_k,
        x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), *strides(s13, fmt != MODEL_DTYPE),
        strides(r13, fmt == NVFP4)[0], act.stride(0),
        BLOCK_M=bm, BLOCK_N=cfg_gu.block_n, BLOCK_K=cfg_gu.block_k, IEEE=ieee, FMT=fmt,
        num_warps=cfg_gu.num_warps, num_stages=cfg_gu.num_stages)
    y = torch.empty((choices, h), dtype=x.dtype, device=x.device)
    _grouped_down_kernel[(blocks, triton.cdiv(h, cfg_down.block_n))](
        act, down_proj, s2, r2, rw, y, sorted_ids, expert_ids, choices, h, inter,
        act.stride(0), down_proj.stride(0), down_proj.stride(1), *strides(s2, fmt != MODEL_DTYPE),
        strides(r2, fmt == NVFP4)[0], y.stride(0),
        BLOCK_M=bm, BLOCK_N=cfg_down.block_n, BLOCK_K=cfg_down.block_k, IEEE=ieee, FMT=fmt,
        num_warps=cfg_down.num_warps, num_stages=cfg_down.num_stages)
    return torch.sum(y.view(n, top_k, h), dim=1, out=out)


FP8_GROUP = FP8_BLOCK_K  # the checkpoints' weight_block_size (block_fp8.GROUP)


def _weight_format(gate_up_proj, down_proj, w13_scale, w2_scale, w13_row_scale, w2_row_scale) -> int:
    """MODEL_DTYPE (no scales), FP8 (block scales of E4M3 weights) or NVFP4 (uint8 weights, group and
    row scales); FP8's scale shapes checked here."""
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("w13_scale, w2_scale: give both (quantized experts) or neither")
    if (w13_row_scale is None) != (w2_row_scale is None) or (w13_row_scale is not None and w13_scale is None):
        raise ValueError("w13_row_scale, w2_row_scale: give both, with w13_scale and w2_scale (NVFP4 experts), or neither")
    if w13_scale is None:
        return MODEL_DTYPE
    if w13_row_scale is not None:
        for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            if w.dtype != torch.uint8:
                raise ValueError(f"{name}: NVFP4 experts hold packed E2M1 codes as torch.uint8, got {w.dtype}")
        return NVFP4
    for name, w, sc in (("w13_scale", gate_up_proj, w13_scale), ("w2_scale", down_proj, w2_scale)):
        if w.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}: given for weights of dtype {w.dtype}, expected torch.float8_e4m3fn")
        want = (w.shape[0], triton.cdiv(w.shape[1], FP8_GROUP), triton.cdiv(w.shape[2], FP8_GROUP))
        if tuple(sc.shape) != want or sc.dtype != torch.float32 or sc.stride(-1) != 1:
            raise ValueError(f"{name}: expected float32 {list(want)} (last dim contiguous), "
                             f"got {sc.dtype} {list(sc.shape)}")
    return FP8


def _check_nvfp4_scales(h, inter, w13_scale, w2_scale, w13_row_scale, w2_row_scale) -> None:
    if h % NVFP4_GROUP or inter % NVFP4_GROUP:
        raise ValueError(f"NVFP4 experts: H {h} and I {inter} must be multiples of {NVFP4_GROUP}")
    e = w13_scale.shape[0]
    for name, t, want, dtype in (("w13_scale", w13_scale, (e, 2 * inter, h // NVFP4_GROUP), torch.float8_e4m3fn),
                                 ("w2_scale", w2_scale, (e, h, inter // NVFP4_GROUP), torch.float8_e4m3fn),
                                 ("w13_row_scale", w13_row_scale, (e, 2 * inter), torch.float32),
                                 ("w2_row_scale", w2_row_scale, (e, h), torch.float32)):
        if tuple(t.shape) != want or t.dtype != dtype or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected {dtype} {list(want)} (last dim contiguous), got {t.dtype} "
                             f"{list(t.shape)}")
