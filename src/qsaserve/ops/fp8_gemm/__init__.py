"""Linear layers with FP8 E4M3 weights and float32 block / channel / tensor scales (layout in
reference.py), dispatched (`ops.dispatch.use_triton`): on CUDA the Triton kernels, else the torch
references. `fp8_linear` is what layers call, on every device the same numerics (so the CPU
reference computes what the GPU does; `fp8_linear_rms_norm`'s joined kernel is the one exception:
on CUDA it does not round the normalized input to the activation dtype): up to reference.W8A16_ROWS (2) rows W8A16 (bf16
activations; on CUDA the FMA GEMV, triton_gemv.py), more rows W8A8 with per-token-group
activation scales (triton_quant.py), and W8A8 from 2 rows for weights of W8A8_DECODE_MIN_N rows or
more (reference.takes_w8a8). On CUDA the W8A8 rows run the transposed split-K GEMM
(triton_w8a8_swap.py) up to DECODE_ROWS (64; decode and verify steps, from 2 rows for the wide
weights; up to NARROW_SWAP_ROWS for weights of at most NARROW_N rows, takes_swap), and above it, for bf16
activations by 128 x 128 block weights on sm_90, cuBLAS's block-scaled GEMM (scaled_mm.takes),
else the Triton prefill GEMM (triton_gemm.py): at 128-256 rows cuBLAS led the transposed kernel
on an H200 (docs/weight_quantization.md).
QSASERVE_FP8_DECODE_KERNEL=swap / tile (reference.DECODE_KERNEL, read at import) keeps W8A16 up
to 64 rows on the transposed (triton_swap_ab.py) or untransposed (triton_gemm.py) W8A16 kernel,
for A/B runs."""
from __future__ import annotations

from typing import NamedTuple

import torch

from qsaserve.ops import fused
from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.fp8_gemm import reference, scaled_mm
from qsaserve.ops.fp8_gemm.reference import (DECODE_KERNEL, DECODE_ROWS, FP8, GROUP, NARROW_N, NARROW_SWAP_ROWS,
                                             RESIDUAL_ROWS, W8A8_DECODE_MIN_N, W8A16_ROWS,
                                             dequantize_weight, expand_scale, quantize_weight_block,
                                             quantize_weight_rows, takes_w8a8)

try:  # CPU-only installs keep the references
    from qsaserve.ops.fp8_gemm import (triton_gemm, triton_gemv, triton_gemv_joined, triton_quant, triton_swap_ab,
                                       triton_w8a8_swap)
except ImportError:
    triton_gemm = triton_gemv = triton_gemv_joined = triton_quant = triton_swap_ab = triton_w8a8_swap = None

# Up to this many rows the W8A16 op runs as the FMA GEMV: measured on an H200 (bench_fp8_gemm,
# 58189b2) it led at 1 and 2 rows on every llama-8b shape, at 4 rows the tile kernel led on the
# largest (gate_up 48.3 against 57.1 us; the FMAs' issue rate, not the bandwidth, bounds it).
GEMV_ROWS = 2


def per_token_group_quant(x: torch.Tensor, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (E4M3 [M, K], scale [M, ceil(K/128)] float32). gated: x is [M, 2K] (gate | up)
    and the quantized value SiLU(gate) * up (as ops.fused.silu_mul rounds it)."""
    if use_triton(x):
        return triton_quant.per_token_group_quant_triton(x, gated=gated)
    return reference.per_token_group_quant_reference(fused.silu_mul(x) if gated else x)


def takes_swap(m: int, n: int) -> bool:
    """On CUDA the W8A8 product of m rows by an n-row weight runs the transposed GEMM: up to
    DECODE_ROWS rows, and up to NARROW_SWAP_ROWS for weights of at most NARROW_N rows."""
    return m <= DECODE_ROWS or (m <= NARROW_SWAP_ROWS and n <= NARROW_N)


def fp8_w8a8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] E4M3, x_scale [M, ceil(K/128)], w [N, K] E4M3, w_scale [Sn, Sk] -> [M, N] out_dtype."""
    if use_triton(xq):
        if takes_swap(xq.shape[0], w.shape[0]):
            return triton_w8a8_swap.fp8_w8a8_swap_triton(xq, x_scale, w, w_scale, block_n, out_dtype)
        return triton_gemm.fp8_w8a8_gemm_triton(xq, x_scale, w, w_scale, block_n, out_dtype)
    return reference.fp8_w8a8_gemm_reference(xq, x_scale, w, w_scale, block_n, out_dtype)


def fp8_w8a16_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int) -> torch.Tensor:
    """x [M, K], w [N, K] E4M3, w_scale [Sn, Sk] -> [M, N] in x's dtype."""
    if use_triton(x):
        if x.shape[0] <= GEMV_ROWS:
            return triton_gemv.fp8_gemv_triton(x, w, w_scale, block_n)
        if DECODE_KERNEL == "tile":
            return triton_gemm.fp8_w8a16_gemm_triton(x, w, w_scale, block_n)
        return triton_swap_ab.fp8_w8a16_swap_triton(x, w, w_scale, block_n)
    return reference.fp8_w8a16_gemm_reference(x, w, w_scale, block_n)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> x @ W^T (+ bias) [T, N] in x's dtype (reference.fp8_linear_reference)."""
    if not takes_w8a8(x.shape[0], w.shape[0]):
        y = fp8_w8a16_gemm(x, w, w_scale, block_n)
    else:
        y = _w8a8_linear(x, w, w_scale, block_n)
    return y if bias is None else y + bias


def _w8a8_linear(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
                 gated: bool = False) -> torch.Tensor:
    """x quantized per token group, then the W8A8 GEMM (cuBLAS's block-scaled one above DECODE_ROWS
    rows where scaled_mm.takes). gated: x is gate | up, the input SiLU(gate) * up."""
    if not takes_swap(x.shape[0], w.shape[0]) and use_triton(x) and scaled_mm.takes(x, w, w_scale, block_n):
        return scaled_mm.fp8_linear_scaled_mm(x, w, w_scale, gated=gated)
    xq, xs = per_token_group_quant(x, gated=gated)
    return fp8_w8a8_gemm(xq, xs, w, w_scale, block_n, x.dtype)


def fp8_linear_silu_mul(gate_up: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2K] (gate | up) -> (SiLU(gate) * up) @ W^T (+ bias) [T, N], as
    fp8_linear(ops.fused.silu_mul(gate_up), ...): on CUDA at the GEMV's rows one launch, the GEMV
    computing SiLU * up as it loads its input, and at W8A8 rows the activation quantization doing
    so (both rounded where silu_mul rounds: the same values, one launch fewer)."""
    m = gate_up.shape[0]
    joined = use_triton(gate_up) and 0 < m and gate_up.dim() == 2 and gate_up.stride(-1) == 1
    if joined and takes_w8a8(m, w.shape[0]):  # the activation quantization computes SiLU * up
        y = _w8a8_linear(gate_up, w, w_scale, block_n, gated=True)
    elif joined and m <= GEMV_ROWS:  # the GEMV does
        y = triton_gemv.fp8_gemv_triton(gate_up, w, w_scale, block_n, gated=True)
    else:
        return fp8_linear(fused.silu_mul(gate_up), w, w_scale, block_n, bias)
    return y if bias is None else y + bias


def fp8_linear_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                        w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
                        bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (a block's output), residual [T, K] or None -> (fp8_linear(h) [T, N], the next
    residual), h = RMSNorm(x + residual) * norm_weight, as ops.fused.add_rms_norm (rms_norm and x
    itself without a residual) then fp8_linear: on CUDA at the GEMV's rows one launch
    (triton_gemv.fp8_norm_gemv_triton: the normalized input stays float32 inside the GEMV, not
    rounded to x's dtype), at W8A8 rows the norm's kernel quantizing its output
    (triton_quant.rms_norm_quant_triton, bit-equal to the norm then the quantization) and the GEMM;
    elsewhere the two ops."""
    m = x.shape[0]
    joinable = use_triton(x) and x.dim() == 2 and 0 < m and (residual is None or residual.dtype == x.dtype)
    if joinable and m <= GEMV_ROWS and not takes_w8a8(m, w.shape[0]):
        y, summed = triton_gemv.fp8_norm_gemv_triton(x, residual, norm_weight, eps, w, w_scale, block_n)
        return (y if bias is None else y + bias), summed
    if joinable and takes_w8a8(m, w.shape[0]) and x.shape[1] % GROUP == 0 and x.stride(-1) == 1:
        # the norm's kernel quantizes its output for the W8A8 GEMM (one launch and bf16 round trip fewer)
        cublas = not takes_swap(m, w.shape[0]) and scaled_mm.takes(x, w, w_scale, block_n)
        xq, xs, summed = triton_quant.rms_norm_quant_triton(
            x, None if residual is None else residual.contiguous(), norm_weight.contiguous(), eps,
            scaled_mm.ROWS_MULTIPLE if cublas else 1, scale_column_major=cublas)
        y = (scaled_mm.fp8_w8a8_gemm_scaled_mm(xq, xs, w, w_scale, x.dtype)[:m] if cublas
             else fp8_w8a8_gemm(xq, xs, w, w_scale, block_n, x.dtype))
        return (y if bias is None else y + bias), summed
    h, summed = fused.rms_norm_residual(x, residual, norm_weight, eps)
    return fp8_linear(h, w, w_scale, block_n, bias), summed


class SummedResidual(NamedTuple):
    """A block output that the projection producing it already added to the residual stream
    (fp8_linear_residual), with the next RMSNorm's numerator: h [T, K] the residual stream, hg =
    h * norm_weight [T, K] (both in the activation dtype), partials [P, 4] float32, the producer's
    per-program sums of h's squares (row r in column r), and the norm weight hg was made with."""
    h: torch.Tensor
    hg: torch.Tensor
    partials: torch.Tensor
    norm_weight: torch.Tensor


def joins_residual(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None,
                   bias: torch.Tensor | None = None, gated: bool = False) -> bool:
    """fp8_linear_residual's joined kernel takes this call: on CUDA, 1-RESIDUAL_ROWS rows on the
    GEMV (not W8A8), no bias, a residual of the output's shape and x's dtype."""
    return (x.dim() == 2 and _joined_gemv_rows(x, w) and bias is None and residual is not None
            and residual.dtype == x.dtype and residual.shape == (x.shape[0], w.shape[0])
            and (not gated or x.stride(-1) == 1))


def _joined_gemv_rows(x: torch.Tensor, w: torch.Tensor) -> bool:
    """x's rows take the joined GEMVs (triton_gemv_joined) with this weight: on CUDA,
    1-RESIDUAL_ROWS rows that stay W8A16 (a wide weight's 2 rows take W8A8)."""
    m = x.shape[0]
    return use_triton(x) and 0 < m <= RESIDUAL_ROWS and not takes_w8a8(m, w.shape[0])


def fp8_linear_residual(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
                        residual: torch.Tensor, norm_weight: torch.Tensor, gated: bool = False) -> SummedResidual:
    """fp8_linear(x) (fp8_linear_silu_mul's input when gated) added to the residual, with the next
    RMSNorm's numerator, in one launch (triton_gemv_joined.fp8_gemv_residual_triton). Only where
    joins_residual."""
    h, hg, partials = triton_gemv_joined.fp8_gemv_residual_triton(x, w, w_scale, block_n, residual, norm_weight, gated=gated)
    return SummedResidual(h, hg, partials, norm_weight)


def fp8_linear_prenormed(summed: SummedResidual, eps: float, w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm(summed.h) * summed.norm_weight @ W^T (+ bias): at the GEMV's rows one launch
    (triton_gemv_joined.fp8_prenormed_gemv_triton, the normalization applied to the float32 sums),
    elsewhere fp8_linear_rms_norm of summed.h (at W8A8 rows on CUDA the norm's kernel quantizing)."""
    if prenormed_joins(summed, w):
        y = triton_gemv_joined.fp8_prenormed_gemv_triton(summed.hg, summed.partials, eps, w, w_scale, block_n)
        return y if bias is None else y + bias
    return fp8_linear_rms_norm(summed.h, None, summed.norm_weight, eps, w, w_scale, block_n, bias)[0]


def prenormed_joins(summed: SummedResidual, w: torch.Tensor) -> bool:
    """fp8_linear_prenormed takes the prenormed GEMV for this weight (else RMSNorm, fp8_linear)."""
    return _joined_gemv_rows(summed.hg, w)


def fp8_linear_prenormed_rope_kv(summed: SummedResidual, eps: float, w: torch.Tensor, w_scale: torch.Tensor,
                                 block_n: int, num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
                                 cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                                 slot_mapping: torch.Tensor) -> torch.Tensor:
    """fp8_linear_prenormed of a fused q | k | v projection, with q and k rotated (RoPE) and k, v
    written to kv_cache at slot_mapping in the same launch
    (triton_gemv_joined.fp8_prenormed_rope_kv_triton). Only where prenormed_joins (the caller
    checks the cache takes a plain write)."""
    return triton_gemv_joined.fp8_prenormed_rope_kv_triton(summed.hg, summed.partials, eps, w, w_scale, block_n,
                                                           num_q_heads, num_kv_heads, positions, cos, sin, kv_cache,
                                                           slot_mapping)


__all__ = ["DECODE_KERNEL", "DECODE_ROWS", "FP8", "GEMV_ROWS", "GROUP", "W8A8_DECODE_MIN_N", "W8A16_ROWS", "takes_w8a8", "dequantize_weight", "expand_scale", "fp8_linear", "fp8_linear_prenormed", "fp8_linear_prenormed_rope_kv", "fp8_linear_residual", "fp8_linear_rms_norm", "fp8_linear_silu_mul",
           "joins_residual", "prenormed_joins", "RESIDUAL_ROWS", "SummedResidual", "takes_swap", "fp8_w8a16_gemm",
           "fp8_w8a8_gemm", "per_token_group_quant", "quantize_weight_block", "quantize_weight_rows"]
