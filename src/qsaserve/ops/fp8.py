"""FP8 E4M3 (the `fn` variant: no infinities, 0x7F/0xFF are NaN, largest finite 448) KV storage.

A stored value is round(clamp(x / scale, -448, 448)); reading multiplies by the same scale.
Scales are per layer and per tensor (one for K, one for V), kept as 0-d float32 device tensors
built once, so a step never creates host tensors (safe to capture in a CUDA graph).
"""
from __future__ import annotations

import torch

FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_E4M3


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (any float dtype) -> E4M3 of x / scale. Clamped first: torch's cast of an out-of-range
    value is not guaranteed to saturate, and a NaN in the cache would poison every later read."""
    return (x.float() / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 -> float32 x * scale."""
    return x.float() * scale


def store_rows(cache: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, scale: torch.Tensor | None) -> None:
    """cache[rows] = values along dim 0, quantizing when the cache is E4M3. index_copy_ has no CPU
    kernel for float8, so E4M3 rows are copied as their bytes."""
    if is_fp8(cache.dtype):
        if scale is None:
            raise ValueError("an fp8_e4m3 KV cache needs its layer's k_scale/v_scale")
        cache.view(torch.uint8).index_copy_(0, rows, quantize_fp8(values, scale).view(torch.uint8))
    else:
        cache.index_copy_(0, rows, values.to(cache.dtype))


def load_rows(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Gathered cache rows -> float32 (dequantized when E4M3)."""
    if not is_fp8(x.dtype):
        return x.float()
    if scale is None:
        raise ValueError("an fp8_e4m3 KV cache needs its layer's k_scale/v_scale")
    return dequantize_fp8(x, scale)
