"""Linear layers with NVFP4 weights (ModelOpt layout, reference.py) run as W4A16, dispatched
(`ops.dispatch.use_triton`): the Triton kernel on CUDA (triton_gemm.py), else the reference."""
from __future__ import annotations

import torch

from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.nvfp4_gemm import reference
from qsaserve.ops.nvfp4_gemm.reference import GROUP, dequantize_nvfp4, quantize_nvfp4

try:  # CPU-only installs keep the reference
    from qsaserve.ops.nvfp4_gemm import triton_gemm
except ImportError:
    triton_gemm = None


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> x @ W^T (+ bias) [T, N] in x's dtype."""
    if use_triton(x):
        y = triton_gemm.nvfp4_w4a16_gemm_triton(x, packed, scale, row_scale)
    else:
        y = reference.nvfp4_w4a16_gemm_reference(x, packed, scale, row_scale)
    return y if bias is None else y + bias


__all__ = ["GROUP", "dequantize_nvfp4", "nvfp4_linear", "quantize_nvfp4"]
