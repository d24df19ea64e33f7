"""Linear layers with NVFP4 weights (ModelOpt layout, reference.py) run as W4A16, dispatched
(`ops.dispatch.use_triton`): on CUDA the FMA GEMV (triton_gemv.py) up to GEMV_ROWS rows and the
tensor-core kernel (triton_gemm.py) above, else the reference (the same math for both).
QSASERVE_NVFP4_DECODE_KERNEL=swap (read at import) takes the transposed kernel
(triton_swap_ab.py) from GEMV_ROWS + 1 to SWAP_ROWS rows instead, until the H200 measurement
decides the default."""
from __future__ import annotations

import os

import torch

from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.nvfp4_gemm import reference
from qsaserve.ops.nvfp4_gemm.reference import GROUP, dequantize_nvfp4, quantize_nvfp4

try:  # CPU-only installs keep the reference
    from qsaserve.ops.nvfp4_gemm import triton_gemm, triton_gemv, triton_swap_ab
except ImportError:
    triton_gemm = triton_gemv = triton_swap_ab = None

GEMV_ROWS = 4  # up to this many rows the GEMV (tl.dot would pad them to 16)
SWAP_ROWS = 64  # decode batches; prefill chunks keep the tile kernel
DECODE_KERNELS = ("tile", "swap")
DECODE_KERNEL = os.environ.get("QSASERVE_NVFP4_DECODE_KERNEL", "tile")
if DECODE_KERNEL not in DECODE_KERNELS:
    raise ValueError(f"QSASERVE_NVFP4_DECODE_KERNEL: one of {', '.join(DECODE_KERNELS)}, got {DECODE_KERNEL!r}")
SWAP_TILE = dict(block_n_tile=128, split_k=2, num_warps=4, num_stages=4)  # until its sweep is measured


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> x @ W^T (+ bias) [T, N] in x's dtype."""
    if use_triton(x) and x.shape[0] <= GEMV_ROWS:
        y = triton_gemv.nvfp4_gemv_triton(x, packed, scale, row_scale)
    elif use_triton(x) and DECODE_KERNEL == "swap" and x.shape[0] <= SWAP_ROWS:
        y = triton_swap_ab.nvfp4_w4a16_swap_triton(x, packed, scale, row_scale, **SWAP_TILE)
    elif use_triton(x):
        y = triton_gemm.nvfp4_w4a16_gemm_triton(x, packed, scale, row_scale)
    else:
        y = reference.nvfp4_w4a16_gemm_reference(x, packed, scale, row_scale)
    return y if bias is None else y + bias


__all__ = ["DECODE_KERNEL", "GEMV_ROWS", "GROUP", "dequantize_nvfp4", "nvfp4_linear", "quantize_nvfp4"]
