"""A PLE table as the gather reads it: row shards [R_s, D] of one dtype, in row order (a real
checkpoint stores each table as 512 shards, which the disk placement maps where they lie). One
gather launch covers every shard: it finds a row's shard by binary search over `starts` and
addresses it relative to shard 0 by `offsets`, so no copy joins the shards."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowShards:
    shards: list[torch.Tensor]  # [R_s, D] each, unit strides, one dtype
    starts: torch.Tensor  # int64 [S + 1] on the gather's device: first row of each shard, then the total
    offsets: torch.Tensor  # int64 [S] on the gather's device: shard s's element offset from shard 0 (kernel)
    starts_host: list[int]

    @property
    def dim(self) -> int:
        return self.shards[0].shape[1]

    @property
    def rows(self) -> int:
        return self.starts_host[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.shards[0].dtype

    @classmethod
    def build(cls, shards: list[torch.Tensor], device: torch.device, device_ptrs: list[int] | None = None) -> RowShards:
        """`device_ptrs`: each shard's address as the device sees it (default data_ptr(): device
        memory, or host memory that UVA maps at the same address)."""
        dim, dtype = shards[0].shape[1], shards[0].dtype
        for s in shards:
            if s.dim() != 2 or s.shape[1] != dim or s.dtype != dtype or (s.shape[0] > 1 and s.stride(0) != dim) \
                    or s.stride(1) != 1:
                raise ValueError(f"RowShards: every shard [R, {dim}] {dtype}, contiguous; got {tuple(s.shape)} "
                                 f"{s.dtype} strides {s.stride()}")
        ptrs = device_ptrs if device_ptrs is not None else [s.data_ptr() for s in shards]
        if any((p - ptrs[0]) % dtype.itemsize for p in ptrs):
            raise ValueError("RowShards: shard addresses are not a whole number of elements apart")
        starts = [0]
        for s in shards:
            starts.append(starts[-1] + s.shape[0])
        offsets = [(p - ptrs[0]) // dtype.itemsize for p in ptrs]
        return cls(list(shards), torch.tensor(starts, dtype=torch.int64, device=device),
                   torch.tensor(offsets, dtype=torch.int64, device=device), starts)
