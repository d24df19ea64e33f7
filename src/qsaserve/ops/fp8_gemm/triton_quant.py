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


__all__ = ["per_token_group_quant_triton"]
