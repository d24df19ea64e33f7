"""Paged KV cache: geometry, sizing from a memory budget, allocation.

Layout per attention layer: one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]
(K then V). A token's slot is block_id * block_size + offset; kernels gather by block table.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, memory_bytes: int) -> int:
        return int(memory_bytes // self.bytes_per_block)


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    # Zero-filled so the null block (block 0) holds finite values.
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
