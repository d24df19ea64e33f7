"""Fused per-token ops of the decoder layers (RMSNorm with residual add, RoPE on q and k, SiLU*up).

The layers call ``use_fused(x)``: Triton kernels for CUDA tensors, the plain-torch references
elsewhere (the CPU path, which is the exact arithmetic the CPU tests compare to transformers).
``QSASERVE_FUSED_KERNELS=0`` in the environment (read at import, so worker processes see it too)
or ``fused.ENABLED = False`` before a model runs keeps CUDA on the torch path, for comparisons.
"""
from __future__ import annotations

import os

import torch

from qsaserve.ops.fused.reference import (add_rms_norm_reference, rms_norm_reference, rope_qk_reference_,
                                          rope_reference, silu_mul_reference)

try:  # CPU-only installs keep the references
    from qsaserve.ops.fused import triton_fused
except ImportError:
    triton_fused = None

ENABLED = os.environ.get("QSASERVE_FUSED_KERNELS", "1") != "0"


def use_fused(x: torch.Tensor) -> bool:
    """True when x's op should run as a fused Triton kernel: a CUDA tensor, kernels available and on."""
    return ENABLED and triton_fused is not None and x.is_cuda


__all__ = ["ENABLED", "use_fused", "triton_fused", "add_rms_norm_reference", "rms_norm_reference",
           "rope_qk_reference_", "rope_reference", "silu_mul_reference"]
