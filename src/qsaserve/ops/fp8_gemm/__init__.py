"""Linear layers with FP8 E4M3 weights and float32 block / channel / tensor scales (layout in
reference.py), dispatched (`ops.dispatch.use_triton`): on CUDA the Triton kernels (triton_gemm.py,
triton_quant.py, triton_gemv.py), else the torch references. `fp8_linear` is what layers call: up
to DECODE_ROWS rows W8A16 (bf16 activations), more rows W8A8 with per-token-group activation
scales, and W8A8 from 2 rows for weights of W8A8_DECODE_MIN_N rows or more (reference.takes_w8a8),
on every device, so the CPU reference computes what the GPU does. On CUDA the W8A16 op
takes the FMA GEMV (triton_gemv.py) up to GEMV_ROWS rows and the transposed tensor-core kernel
(triton_swap_ab.py) above (same math, so the reference is one): on an H200 it beat the
untransposed tile kernel (triton_gemm.py) at 8-64 rows on llama-8b's shapes except gate_up at
8-16 (4% behind), 1.7x over a layer at 64 rows (docs/weight_quantization.md).
QSASERVE_FP8_DECODE_KERNEL=tile (read at import) keeps the tile kernel, for A/B runs. More than
DECODE_ROWS rows (prefill, and steps of more than 64 decode rows) of bf16 activations by 128 x 128
block weights run cuBLAS's block-scaled GEMM on sm_90 (scaled_mm.takes), the Triton W8A8 GEMM
elsewhere."""
from __future__ import annotations

import os

import torch

from qsaserve.ops import fused
from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.fp8_gemm import reference, scaled_mm
from qsaserve.ops.fp8_gemm.reference import (DECODE_ROWS, FP8, GROUP, W8A8_DECODE_MIN_N, dequantize_weight,
                                             expand_scale, quantize_weight_block, quantize_weight_rows, takes_w8a8)

try:  # CPU-only installs keep the references
    from qsaserve.ops.fp8_gemm import triton_gemm, triton_gemv, triton_quant, triton_swap_ab
except ImportError:
    triton_gemm = triton_gemv = triton_quant = triton_swap_ab = None

# Up to this many rows the W8A16 op runs as the FMA GEMV: measured on an H200 (bench_fp8_gemm,
# 58189b2) it led at 1 and 2 rows on every llama-8b shape, at 4 rows the tile kernel led on the
# largest (gate_up 48.3 against 57.1 us; the FMAs' issue rate, not the bandwidth, bounds it).
GEMV_ROWS = 2
DECODE_KERNELS = ("tile", "swap")
DECODE_KERNEL = os.environ.get("QSASERVE_FP8_DECODE_KERNEL", "swap")
if DECODE_KERNEL not in DECODE_KERNELS:
    raise ValueError(f"QSASERVE_FP8_DECODE_KERNEL: one of {', '.join(DECODE_KERNELS)}, got {DECODE_KERNEL!r}")


def per_token_group_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (E4M3 [M, K], scale [M, ceil(K/128)] float32)."""
    if use_triton(x):
        return triton_quant.per_token_group_quant_triton(x)
    return reference.per_token_group_quant_reference(x)


def fp8_w8a8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] E4M3, x_scale [M, ceil(K/128)], w [N, K] E4M3, w_scale [Sn, Sk] -> [M, N] out_dtype."""
    if use_triton(xq):
        return triton_gemm.fp8_w8a8_gemm_triton(xq, x_scale, w, w_scale, block_n, out_dtype)
    return reference.fp8_w8a8_gemm_reference(xq, x_scale, w, w_scale, block_n, out_dtype)


def fp8_w8a16_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int) -> torch.Tensor:
    """x [M, K], w [N, K] E4M3, w_scale [Sn, Sk] -> [M, N] in x's dtype."""
    if use_triton(x):
        if x.shape[0] <= GEMV_ROWS:
            return triton_gemv.fp8_gemv_triton(x, w, w_scale, block_n)
        if DECODE_KERNEL == "swap":
            return triton_swap_ab.fp8_w8a16_swap_triton(x, w, w_scale, block_n)
        return triton_gemm.fp8_w8a16_gemm_triton(x, w, w_scale, block_n)
    return reference.fp8_w8a16_gemm_reference(x, w, w_scale, block_n)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> x @ W^T (+ bias) [T, N] in x's dtype (reference.fp8_linear_reference)."""
    m = x.shape[0]
    if not takes_w8a8(m, w.shape[0]):
        y = fp8_w8a16_gemm(x, w, w_scale, block_n)
    elif m > DECODE_ROWS and use_triton(x) and scaled_mm.takes(x, w, w_scale, block_n):
        y = scaled_mm.fp8_linear_scaled_mm(x, w, w_scale)
    else:
        xq, xs = per_token_group_quant(x)
        y = fp8_w8a8_gemm(xq, xs, w, w_scale, block_n, x.dtype)
    return y if bias is None else y + bias


def fp8_linear_silu_mul(gate_up: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2K] (gate | up) -> (SiLU(gate) * up) @ W^T (+ bias) [T, N], as
    fp8_linear(ops.fused.silu_mul(gate_up), ...): on CUDA at the GEMV's rows one launch, the GEMV
    computing SiLU * up as it loads its input (rounded where silu_mul rounds)."""
    m = gate_up.shape[0]
    if use_triton(gate_up) and 0 < m <= GEMV_ROWS and not takes_w8a8(m, w.shape[0]) and gate_up.stride(-1) == 1:
        y = triton_gemv.fp8_gemv_triton(gate_up, w, w_scale, block_n, gated=True)
        return y if bias is None else y + bias
    return fp8_linear(fused.silu_mul(gate_up), w, w_scale, block_n, bias)


__all__ = ["DECODE_KERNEL", "DECODE_ROWS", "FP8", "GEMV_ROWS", "GROUP", "W8A8_DECODE_MIN_N", "takes_w8a8", "dequantize_weight", "expand_scale", "fp8_linear", "fp8_linear_silu_mul", "fp8_w8a16_gemm",
           "fp8_w8a8_gemm", "per_token_group_quant", "quantize_weight_block", "quantize_weight_rows"]
