"""Merging decode-context-parallel partial attentions (see reference.py for the contract).

`pack_partials`, `merge_packed`, `scale_partials`: the Triton kernels (triton_merge.py) where
`ops.dispatch.use_triton` says so, the torch references elsewhere."""
from __future__ import annotations

import torch

from qsaserve.ops.dcp_merge import reference
from qsaserve.ops.dispatch import use_triton

try:  # CPU-only installs keep the references
    from qsaserve.ops.dcp_merge import triton_merge
except ImportError:
    triton_merge = None


def pack_partials(out: torch.Tensor, lse: torch.Tensor, d: int) -> torch.Tensor:
    """out [T, D*Hl, Dh], lse [T, D*Hl] -> [D, T, Hl, Dh + 1] (row j: rank j's heads, lse last)."""
    fn = triton_merge.pack_partials_triton if use_triton(out) else reference.pack_partials
    return fn(out, lse, d)


def merge_packed(recv: torch.Tensor) -> torch.Tensor:
    """recv [D, T, Hl, Dh + 1] (every rank's partial of this rank's heads) -> out [T, Hl, Dh] fp32."""
    return (triton_merge.merge_packed_triton if use_triton(recv) else reference.merge_packed)(recv)


def scale_partials(out: torch.Tensor, lse: torch.Tensor, lses: torch.Tensor, d: int) -> torch.Tensor:
    """out [T, D*Hl, Dh], lse [T, D*Hl], every rank's lses [D, T, D*Hl] -> this rank's partial at its
    final weight, [D, T, Hl, Dh] (row j goes to rank j)."""
    fn = triton_merge.scale_partials_triton if use_triton(out) else reference.scale_partials
    return fn(out, lse, lses, d)


__all__ = ["pack_partials", "merge_packed", "scale_partials"]
