"""Gated DeltaNet ops: plain-PyTorch references (fla-core argument conventions)."""

from qsaserve.ops.gdn.reference import (
    causal_conv1d_reference,
    causal_conv1d_update_reference,
    gdn_chunk_reference,
    gdn_recurrent_reference,
    l2norm,
)

__all__ = [
    "causal_conv1d_reference",
    "causal_conv1d_update_reference",
    "gdn_chunk_reference",
    "gdn_recurrent_reference",
    "l2norm",
]
