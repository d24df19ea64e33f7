"""Sampling ops on the logits (ops.dispatch chooses): `greedy_pick`, each row's argmax and whether
the row is finite, in one launch on CUDA (triton_pick.py), else the torch reference."""
from __future__ import annotations

import torch

from qsaserve.ops.dispatch import use_triton
from qsaserve.ops.sampling.reference import greedy_pick_reference

try:  # CPU-only installs keep the reference
    from qsaserve.ops.sampling.triton_pick import greedy_pick_triton
except ImportError:
    greedy_pick_triton = None


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B] int64: the first index of each row's largest value; packed
    [B, 2] int64: (token, 1 if every value of the row is finite else 0))."""
    if use_triton(logits) and logits.dim() == 2 and logits.stride(-1) == 1:
        return greedy_pick_triton(logits)
    return greedy_pick_reference(logits)


__all__ = ["greedy_pick", "greedy_pick_reference"]
