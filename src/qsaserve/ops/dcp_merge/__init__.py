"""Merging decode-context-parallel partial attentions (see reference.py for the contract).

`pack_partials`, `merge_packed`, `scale_partials`: the Triton kernels for CUDA tensors (unless
QSASERVE_FUSED_KERNELS=0), the torch references elsewhere."""
from __future__ import annotations

import torch

from qsaserve.ops import fused
from qsaserve.ops.dcp_merge import reference

try:  # CPU-only installs keep the references
    from qsaserve.ops.dcp_merge import triton_merge
except ImportError:
    triton_merge = None


def _fast(x: torch.Tensor) -> bool:
    return triton_merge is not None and fused.use_fused(x)


def pack_partials(out: torch.Tensor, lse: torch.Tensor, d: int) -> torch.Tensor:
    fn = triton_merge.pack_partials_triton if _fast(out) else reference.pack_partials
    return fn(out, lse, d)


def merge_packed(recv: torch.Tensor) -> torch.Tensor:
    return (triton_merge.merge_packed_triton if _fast(recv) else reference.merge_packed)(recv)


def scale_partials(out: torch.Tensor, lse: torch.Tensor, lses: torch.Tensor, d: int) -> torch.Tensor:
    fn = triton_merge.scale_partials_triton if _fast(out) else reference.scale_partials
    return fn(out, lse, lses, d)


__all__ = ["pack_partials", "merge_packed", "scale_partials"]
