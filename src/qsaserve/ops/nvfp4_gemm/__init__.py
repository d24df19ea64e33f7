"""Linear layers with NVFP4 weights (ModelOpt layout, reference.py) run as W4A16, dispatched
(`ops.dispatch.use_triton`): on CUDA the FMA GEMV (triton_gemv.py) up to GEMV_ROWS rows and the
tensor-core kernel (triton_gemm.py) above, else the reference (the same math for all). A weight
of WIDE_N rows or more takes the tile kernel from one row: on an H200 llama-8b's gate_up (28,672
rows) took 73.4-76.9 us in it at 4-16 rows (not timed below 4; its rows pad to 16, so fewer cost
the same) against the GEMV's 94.9 at 1 row, 110.5 at 2 and 146.2 at 4. From
GEMV_ROWS + 1 to SWAP_ROWS rows a weight with too few 64-row blocks to give every SM two programs
(the transposed kernel splits its K instead) takes the transposed kernel
(triton_swap_ab.py) instead: on an H200 at llama-8b's shapes it led on qkv, o and down (8-32
rows, 0.81-0.87x the tile kernel's time) and lost on gate_up (448 row blocks, 1.6x), where the
tile kernel stays (docs/weight_quantization.md). QSASERVE_NVFP4_DECODE_KERNEL (read at import):
auto (that rule), tile or swap (every decode batch), for A/B runs."""
from __future__ import annotations

import os

import torch

from qsaserve.ops.device import num_sms
from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.fp8_gemm.reference import W8A8_DECODE_MIN_N
from qsaserve.ops.nvfp4_gemm import reference
from qsaserve.ops.nvfp4_gemm.reference import GROUP, dequantize_nvfp4, quantize_nvfp4

try:  # CPU-only installs keep the reference
    from qsaserve.ops.nvfp4_gemm import triton_gemm, triton_gemv, triton_swap_ab
except ImportError:
    triton_gemm = triton_gemv = triton_swap_ab = None

GEMV_ROWS = 4  # up to this many rows the GEMV (tl.dot would pad them to 16)
SWAP_ROWS = 64  # decode batches; prefill chunks keep the tile kernel
WIDE_N = W8A8_DECODE_MIN_N  # weights of this many rows skip the GEMV
DECODE_KERNELS = ("auto", "tile", "swap")
DECODE_KERNEL = os.environ.get("QSASERVE_NVFP4_DECODE_KERNEL", "auto")
if DECODE_KERNEL not in DECODE_KERNELS:
    raise ValueError(f"QSASERVE_NVFP4_DECODE_KERNEL: one of {', '.join(DECODE_KERNELS)}, got {DECODE_KERNEL!r}")


def takes_gemv(m: int, n: int) -> bool:
    """Whether a W4A16 product of m rows by a weight of n rows runs as the GEMV on CUDA."""
    return m <= GEMV_ROWS and n < WIDE_N


def takes_swap(m: int, n: int, sms: int) -> bool:
    """Whether a W4A16 product of m rows by a weight of n rows runs transposed on CUDA."""
    if takes_gemv(m, n) or m > SWAP_ROWS or DECODE_KERNEL == "tile":
        return False
    return DECODE_KERNEL == "swap" or -(-n // triton_swap_ab.SWAP_BLOCK_N) < 2 * sms


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> x @ W^T (+ bias) [T, N] in x's dtype."""
    if use_triton(x) and takes_gemv(x.shape[0], packed.shape[0]):
        y = triton_gemv.nvfp4_gemv_triton(x, packed, scale, row_scale)
    elif use_triton(x) and takes_swap(x.shape[0], packed.shape[0], num_sms(x.device)):
        y = triton_swap_ab.nvfp4_w4a16_swap_triton(x, packed, scale, row_scale)
    elif use_triton(x):
        y = triton_gemm.nvfp4_w4a16_gemm_triton(x, packed, scale, row_scale)
    else:
        y = reference.nvfp4_w4a16_gemm_reference(x, packed, scale, row_scale)
    return y if bias is None else y + bias


__all__ = ["DECODE_KERNEL", "GEMV_ROWS", "SWAP_ROWS", "WIDE_N", "takes_gemv", "takes_swap", "GROUP", "dequantize_nvfp4", "nvfp4_linear", "quantize_nvfp4"]
