"""The block-FP8 W8A8 GEMM as torch's block-scaled cuBLAS GEMM: `F.scaled_mm` with the activations
scaled per token and 128 columns (ScalingType.BlockWise1x128) and the weights per 128 x 128 block
(BlockWise128x128), DeepSeek's recipe, which PyTorch runs on sm_90 only (CUDA 12.9+).

Same operands as triton_gemm.fp8_w8a8_gemm_triton (reference.fp8_w8a8_gemm_reference is the
contract of both), in the layouts cuBLAS reads: the activations' rows a multiple of 4 and their
scales column-major (triton_quant.per_token_group_quant_triton writes both when asked), and the
weights' K blocks a multiple of 4 (the 128 x 128 scale grid is passed transposed, a view).
Taken above DECODE_ROWS rows where `takes` holds (fp8_linear): prefill, and decode or verify
steps of more than 64 rows (in CUDA graphs too: cuBLAS captures); QSASERVE_FP8_GEMM=triton (read
at import) keeps the Triton GEMM everywhere, for A/B runs."""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from qsaserve.ops.fp8_gemm.reference import GROUP

ROWS_MULTIPLE = 4  # cuBLAS's block-scaled GEMM wants the activation rows (and scale rows) so aligned
GEMMS = ("auto", "triton")
GEMM = os.environ.get("QSASERVE_FP8_GEMM", "auto")
if GEMM not in GEMMS:
    raise ValueError(f"QSASERVE_FP8_GEMM: one of {', '.join(GEMMS)}, got {GEMM!r}")
_RECIPES = getattr(F, "ScalingType", None)  # torch >= 2.10


def _cuda_at_least(major: int, minor: int) -> bool:
    version = torch.version.cuda
    return version is not None and tuple(int(v) for v in version.split(".")[:2]) >= (major, minor)


@functools.lru_cache(maxsize=None)
def _supported(device: torch.device) -> bool:
    """F.scaled_mm's recipes, a torch built for CUDA 12.9 or later (torch refuses the recipe with an
    older cuBLASLt) and an sm_90 device (asked once per device: fp8_linear asks every call)."""
    return (_RECIPES is not None and hasattr(_RECIPES, "BlockWise128x128") and _cuda_at_least(12, 9)
            and torch.cuda.get_device_capability(device) == (9, 0))


def available(t: torch.Tensor) -> bool:
    """Whether t's device runs the block-scaled GEMM: a CUDA device `_supported`, not
    QSASERVE_FP8_GEMM=triton."""
    return GEMM == "auto" and t.device.type == "cuda" and _supported(t.device)


def takes(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int) -> bool:
    """Whether x [M, K] by the weight w [N, K] (w_scale [Sn, Sk], block_n rows a scale row) runs
    here: `available`, bf16 activations (the output dtype measured; others keep the Triton GEMM),
    128 x 128 block scales, N and K whole blocks, K's blocks a multiple of 4."""
    n, k = w.shape
    return (available(x) and x.dtype == torch.bfloat16 and block_n == GROUP and n % GROUP == 0 and k % (GROUP * 4) == 0
            and tuple(w_scale.shape) == (n // GROUP, k // GROUP) and w_scale.dtype == torch.float32
            and w.is_contiguous() and w_scale.is_contiguous())


def fp8_w8a8_gemm_scaled_mm(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                            out_dtype: torch.dtype) -> torch.Tensor:
    """xq [M', K] E4M3 (M' a multiple of ROWS_MULTIPLE) with x_scale [M', K/128] float32
    column-major (strides (1, M')), w [N, K] E4M3 with w_scale [N/128, K/128] -> [M', N] out_dtype
    (rows past the real tokens are the caller's to drop)."""
    if xq.shape[0] % ROWS_MULTIPLE or x_scale.stride(0) != 1:
        raise ValueError(f"fp8_w8a8_gemm_scaled_mm: xq's rows must be a multiple of {ROWS_MULTIPLE} and x_scale "
                         f"column-major, got {tuple(xq.shape)} and strides {x_scale.stride()}")
    return F.scaled_mm(xq, w.t(), x_scale, _RECIPES.BlockWise1x128, w_scale.t(), _RECIPES.BlockWise128x128,
                       output_dtype=out_dtype)


def fp8_linear_scaled_mm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, gated: bool = False) -> torch.Tensor:
    """x [M, K] bf16 -> x @ W^T [M, N] where `takes` holds: the activations quantized per token and
    128 columns in cuBLAS's layout (padded rows, column-major scales), the GEMM, the padding dropped.
    gated: x is [M, 2K] (gate | up) and the input SiLU(gate) * up (triton_quant's gated form)."""
    from qsaserve.ops.fp8_gemm import triton_quant  # CUDA only, as this GEMM

    xq, xs = triton_quant.per_token_group_quant_triton(x, ROWS_MULTIPLE, scale_column_major=True, gated=gated)
    return fp8_w8a8_gemm_scaled_mm(xq, xs, w, w_scale, x.dtype)[: x.shape[0]]


__all__ = ["GEMM", "ROWS_MULTIPLE", "available", "fp8_linear_scaled_mm", "fp8_w8a8_gemm_scaled_mm", "takes"]
