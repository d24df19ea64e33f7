"""Dynamic per-token-group FP8 quantization of activations (the A operand of the W8A8 GEMM): one
program per token and GROUPS_PER_PROGRAM groups of 128 columns reads them once, writes their E4M3
values and each group's float32 scale amax / 448 (reference.per_token_group_quant_reference).

The value is rounded to the E4M3 grid (nearest, ties to even) in float32 before the cast, so the
cast itself is exact: Triton 3.6's interpreter drops the carry when a cast rounds up into the next
power of two (127.4 -> 64), and the kernel must agree with its reference there too."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.fp8_gemm.reference import _EPS, FP8, FP8_MAX, GROUP
from qsaserve.ops.fused.triton_fused import norm_launch_config, rms_norm_row


@triton.jit
def _round_to_e4m3(y):
    """y float32, |y| <= 448 -> y rounded to the nearest E4M3 value (ties to even), as float32."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # subnormals share the step of 2^-6
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds |v| < 2^22 to an integer, ties to even
    return ((y / step + magic) - magic) * step


@triton.jit(do_not_specialize=["M"])  # the real rows change with every step: one build for all
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, G, stride_xm, stride_qm, stride_sm, stride_sg,
                        FP8_MAX_: tl.constexpr, EPS: tl.constexpr, GROUP_: tl.constexpr, GROUPS: tl.constexpr,
                        GATED: tl.constexpr = False):
    m = tl.program_id(0).to(tl.int64)  # rows from M on are padding: zeros, unit scales
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    k = g[:, None] * GROUP_ + tl.arange(0, GROUP_)[None, :]  # [GROUPS, 128]
    ok = k < K
    x = tl.load(x_ptr + m * stride_xm + k, mask=ok & (m < M), other=0.0).to(tl.float32)
    if GATED:  # x holds gate | up: the value is SiLU(gate) * up, rounded where ops.fused.silu_mul rounds
        dt = x_ptr.dtype.element_ty
        up = tl.load(x_ptr + m * stride_xm + K + k, mask=ok & (m < M), other=0.0).to(tl.float32)
        act = (x / (1.0 + tl.exp(-x))).to(dt).to(tl.float32)
        x = (act * up).to(dt).to(tl.float32)
    scale = tl.where(m < M, tl.maximum(tl.max(tl.abs(x), 1) / FP8_MAX_, EPS), 1.0)
    q = _round_to_e4m3(tl.clamp(x / scale[:, None], -FP8_MAX_, FP8_MAX_))
    tl.store(q_ptr + m * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + m * stride_sm + g * stride_sg, scale, mask=g < G)


GROUPS_PER_PROGRAM = 8  # 1,024 columns a program: one group a program (128 values) left the HBM idle


def per_token_group_quant_triton(x: torch.Tensor, rows_multiple: int = 1, scale_column_major: bool = False,
                                 gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit last stride) -> (E4M3 [M', K], scale [M', ceil(K/128)] float32), M' = M
    rounded up to rows_multiple (the extra rows zero, their scales one); scale_column_major: the
    scales' rows adjacent in memory (strides (1, M')), the layout cuBLAS's block-scaled GEMM reads
    (scaled_mm.py). gated: x is [M, 2K] (gate | up) and what is quantized is SiLU(gate) * up,
    bit-equal to ops.fused.silu_mul then this (one launch and one bf16 round trip fewer)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    if gated:
        if k % 2:
            raise ValueError(f"per_token_group_quant: gated x must be [M, 2K], got {tuple(x.shape)}")
        k //= 2
    g = triton.cdiv(k, GROUP)
    rows = -(-m // rows_multiple) * rows_multiple
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    s = (torch.empty((g, rows), dtype=torch.float32, device=x.device).t() if scale_column_major
         else torch.empty((rows, g), dtype=torch.float32, device=x.device))
    if rows and k:
        groups = min(GROUPS_PER_PROGRAM, triton.next_power_of_2(g))
        _group_quant_kernel[(rows, triton.cdiv(g, groups))](
            x, q, s, m, k, g, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
            FP8_MAX_=FP8_MAX, EPS=_EPS, GROUP_=GROUP, GROUPS=groups, GATED=gated, num_warps=4 if groups >= 4 else 1)
    return q, s


# M and the scale strides unspecialized: the scales' row stride is the padded row count in cuBLAS's
# column-major layout, which would otherwise build a variant per divisibility of every step's rows
@triton.jit(do_not_specialize=["M", "eps", "stride_sm", "stride_sg"])
def _rms_norm_quant_kernel(x_ptr, res_ptr, w_ptr, sum_ptr, q_ptr, s_ptr, M, K, eps, stride_xm, stride_rm,
                           stride_hm, stride_qm, stride_sm, stride_sg, HAS_RESIDUAL: tl.constexpr,
                           BLOCK: tl.constexpr, FP8_MAX_: tl.constexpr, EPS: tl.constexpr, GROUP_: tl.constexpr):
    """One row: ops.fused's RMSNorm (with the residual add) exactly as its _rms_norm_kernel computes
    it (its rms_norm_row, the same BLOCK and warps: the same reduction), rounded to x's dtype, then
    _group_quant_kernel's quantization of that row, 128 columns a group. Rows from M on are
    padding: zeros, unit scales."""
    m = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (cols < K) & (m < M)
    x = tl.load(x_ptr + m * stride_xm + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + m * stride_rm + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + m * stride_hm + cols, x, mask=mask)
    normed = rms_norm_row(x, tl.load(w_ptr + cols, mask=cols < K, other=0.0), K, eps)
    normed = tl.reshape(normed.to(x_ptr.dtype.element_ty).to(tl.float32), (BLOCK // GROUP_, GROUP_))
    g = tl.arange(0, BLOCK // GROUP_)
    k = g[:, None] * GROUP_ + tl.arange(0, GROUP_)[None, :]
    scale = tl.where(m < M, tl.maximum(tl.max(tl.abs(normed), 1) / FP8_MAX_, EPS), 1.0)
    q = _round_to_e4m3(tl.clamp(normed / scale[:, None], -FP8_MAX_, FP8_MAX_))
    tl.store(q_ptr + m * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + m * stride_sm + g * stride_sg, scale, mask=g * GROUP_ < K)


def rms_norm_quant_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                          rows_multiple: int = 1,
                          scale_column_major: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128), residual [M, K] or None, weight [K] -> (E4M3 [M', K], scale
    [M', K/128] float32, h): h = x + residual (a new tensor; x itself without a residual) and the
    quantized value that of ops.fused.add_rms_norm (rms_norm) then per_token_group_quant_triton,
    bit for bit, in one launch; M', rows_multiple and scale_column_major as there."""
    if x.dim() != 2 or x.shape[1] % GROUP or x.stride(-1) != 1 or weight.shape != (x.shape[1],) or not weight.is_contiguous():
        raise ValueError(f"rms_norm_quant: x [M, K] with K a multiple of {GROUP} and a unit last stride, weight [K]; "
                         f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError(f"rms_norm_quant: residual must be x's shape {tuple(x.shape)} and dtype with a unit last "
                         f"stride, got {tuple(residual.shape)} {residual.dtype}")
    m, k = x.shape
    g = k // GROUP
    rows = -(-m // rows_multiple) * rows_multiple
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    s = (torch.empty((g, rows), dtype=torch.float32, device=x.device).t() if scale_column_major
         else torch.empty((rows, g), dtype=torch.float32, device=x.device))
    h = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if rows:
        block, warps = norm_launch_config(k)  # the norm's own launch: its reduction
        res = x if residual is None else residual
        _rms_norm_quant_kernel[(rows,)](
            x, res, weight, h, q, s, m, k, eps, x.stride(0), res.stride(0), h.stride(0), q.stride(0), s.stride(0),
            s.stride(1), HAS_RESIDUAL=residual is not None, BLOCK=block, FP8_MAX_=FP8_MAX, EPS=_EPS, GROUP_=GROUP,
            num_warps=warps)
    return q, s, h


__all__ = ["per_token_group_quant_triton", "rms_norm_quant_triton"]
