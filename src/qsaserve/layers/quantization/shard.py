"""The range of a checkpoint tensor a rank keeps, as the quantized linear layers take it."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorShard:
    """This rank keeps the index ranges `ranges` ([start, end) each, concatenated) of dimension
    `dim` (0: output rows, 1: input columns) of a checkpoint tensor whose size along dim is `full`."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full: int


def take_shard(tensor: torch.Tensor, shard: TensorShard | None) -> torch.Tensor:
    if shard is None:
        return tensor
    parts = [tensor.narrow(shard.dim, a, b - a) for a, b in shard.ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, shard.dim)


def copy_part(name: str, kind: str, part: int, target: torch.Tensor, value: torch.Tensor) -> None:
    """Copies this rank's slice `value` of a checkpoint tensor into its place `target` in a
    layer's parameter, refusing a shape mismatch with the layer, tensor kind and part named."""
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"model: {name} {kind} (part {part}) has shape {tuple(value.shape)} for this rank, "
                         f"expected {tuple(target.shape)}")
    target.copy_(value.to(target.device))


__all__ = ["TensorShard", "copy_part", "take_shard"]
