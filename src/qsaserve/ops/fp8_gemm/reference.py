"""Torch references of the FP8-weight linear ops (the contract of the Triton kernels beside them):
dequantize, then one float32 matmul, rounded once to the output dtype.

A weight is E4M3 `w` [N, K] with float32 dequantization multipliers `scale` [Sn, Sk]: row n, column
k reads scale[n // block_n, k // GROUP] (Sk > 1) or scale[n // block_n, 0] (Sk == 1: per-channel or
per-tensor). This one layout covers block-128 (block_n 128), per-channel (block_n 1) and per-tensor
(one value per block_n rows) weights, and fused projections whose parts are not 128-row multiples
(block_n a common divisor of the parts, layers/quantization/fp8.py)."""
from __future__ import annotations

import os

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
GROUP = 128  # columns per K block of weight scales, and per activation quantization group
DECODE_ROWS = 64  # up to this many rows take the decode kernels, more the prefill GEMM
RESIDUAL_ROWS = 2  # rows the residual-joined FP8 GEMV and the prenormed GEMV after it take (CUDA; the GEMV's)
# On CUDA a weight of at most NARROW_N rows keeps the transposed W8A8 GEMM (triton_w8a8_swap.py) up
# to NARROW_SWAP_ROWS rows: cuBLAS's block-scaled GEMM tiles it into <= 32 programs of 128 x 128 on
# 132 SMs (llama-8b's o and down at 128 rows: 16.2 and 41.7 us with the quantization, against 17.0
# and 46.2 for cuBLAS; fp8_swap_h200_2026-12-03_69ea61a.json). Wider weights (qkv, gate_up) and
# more rows take cuBLAS above DECODE_ROWS.
NARROW_N = 32 * 128
NARROW_SWAP_ROWS = 128
# Up to this many rows the activations stay bf16 (W8A16: the FMA GEMV), more are quantized (W8A8).
# QSASERVE_FP8_DECODE_KERNEL=swap / tile (read at import, for A/B runs) keeps W8A16 up to
# DECODE_ROWS on the W8A16 tensor-core kernels, the decode path before the transposed W8A8 GEMM
# (triton_w8a8_swap.py), which read llama-8b's weights 1.3-1.5x faster at 8-64 rows on an H200
# (docs/weight_quantization.md).
DECODE_KERNELS = ("w8a8", "swap", "tile")
DECODE_KERNEL = os.environ.get("QSASERVE_FP8_DECODE_KERNEL", "w8a8")
if DECODE_KERNEL not in DECODE_KERNELS:
    raise ValueError(f"QSASERVE_FP8_DECODE_KERNEL: one of {', '.join(DECODE_KERNELS)}, got {DECODE_KERNEL!r}")
W8A16_ROWS = 2 if DECODE_KERNEL == "w8a8" else DECODE_ROWS
# ... except that a weight of this many rows or more takes W8A8 from 2 rows (measured when W8A8 at
# decode rows was the 64 x 128 tile GEMM, whose tiles fill 132 SMs at this width: llama-8b's gate_up,
# 28,672 rows, ran in 37.7 us at 4-64 rows against 48.7-137 us W8A16; docs/weight_quantization.md;
# its 2-row steps now take the transposed W8A8 GEMM, timed from 8 rows); 1 row keeps the GEMV (30.9 us)
W8A8_DECODE_MIN_N = 132 * 128  # (NVFP4's GEMV stops at the same width: nvfp4_gemm.WIDE_N)
_EPS = 1e-10  # an all-zero group gets a tiny scale, not a division by zero


def takes_w8a8(m: int, n: int) -> bool:
    """Whether m rows by an [n, K] weight quantize their activations (W8A8) rather than W8A16."""
    return m > W8A16_ROWS or (m >= 2 and n >= W8A8_DECODE_MIN_N)


def expand_scale(scale: torch.Tensor, block_n: int, n: int, k: int) -> torch.Tensor:
    """scale [Sn, Sk] -> the per-element multiplier [n, k] (float32)."""
    s = scale.float().repeat_interleave(block_n, 0)[:n]
    if s.shape[1] == 1:
        return s.expand(n, k)
    return s.repeat_interleave(GROUP, 1)[:, :k]


def dequantize_weight(w: torch.Tensor, scale: torch.Tensor, block_n: int) -> torch.Tensor:
    """w [N, K] E4M3, scale [Sn, Sk] -> float32 [N, K]."""
    return w.float() * expand_scale(scale, block_n, *w.shape)


def quantize_weight_block(w: torch.Tensor, block: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (E4M3 [N, K], scale [ceil(N/block), ceil(K/block)] float32), the
    DeepSeek / HF `weight_block_size: [128, 128]` layout (scale is `weight_scale_inv`)."""
    n, k = w.shape
    sn, sk = -(-n // block), -(-k // block)
    padded = torch.zeros(sn * block, sk * block, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    tiles = padded.view(sn, block, sk, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(_EPS)
    q = (tiles / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).view(sn * block, sk * block)[:n, :k]
    return q.to(FP8).contiguous(), scale


def quantize_weight_rows(w: torch.Tensor, per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (E4M3 [N, K], scale [N, 1]) per output channel, or [1, 1] per tensor."""
    amax = w.float().abs().amax().reshape(1, 1) if per_tensor else w.float().abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).clamp_min(_EPS)
    return (w.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def per_token_group_quant_reference(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (E4M3 [M, K], scale [M, ceil(K/group)] float32): dynamic activation scales,
    one per token and group of `group` columns (x = q * scale)."""
    m, k = x.shape
    g = -(-k // group)
    padded = torch.zeros(m, g * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    groups = padded.view(m, g, group)
    scale = (groups.abs().amax(dim=2) / FP8_MAX).clamp_min(_EPS)
    q = (groups / scale[:, :, None]).clamp_(-FP8_MAX, FP8_MAX).view(m, g * group)[:, :k]
    return q.to(FP8).contiguous(), scale


def fp8_w8a8_gemm_reference(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                            block_n: int, out_dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] E4M3 with per-token-group x_scale [M, ceil(K/128)], w [N, K] E4M3 with w_scale
    [Sn, Sk] -> [M, N] in out_dtype."""
    x = xq.float() * x_scale.float().repeat_interleave(GROUP, 1)[:, : xq.shape[1]]
    return (x @ dequantize_weight(w, w_scale, block_n).t()).to(out_dtype)


def fp8_w8a16_gemm_reference(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, not quantized), w [N, K] E4M3 with w_scale [Sn, Sk] -> [M, N] in x's dtype."""
    return (x.float() @ dequantize_weight(w, w_scale, block_n).t()).to(x.dtype)


def fp8_linear_reference(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> x @ W^T (+ bias) [M, N] in x's dtype: W8A16 (takes_w8a8 false), else the
    activations are quantized per token and 128-group (W8A8), as on the GPU."""
    if not takes_w8a8(x.shape[0], w.shape[0]):
        y = fp8_w8a16_gemm_reference(x, w, w_scale, block_n)
    else:
        xq, xs = per_token_group_quant_reference(x)
        y = fp8_w8a8_gemm_reference(xq, xs, w, w_scale, block_n, x.dtype)
    return y if bias is None else y + bias
