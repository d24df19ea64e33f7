"""Paged KV cache: geometry, sizing from a memory budget, allocation.

Layout per attention layer: one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]
(K then V), in `kv_dtype` (e.g. FP8 E4M3 with per-layer scales, see quant/) or the model dtype.
A token's slot is block_id * block_size + offset; kernels gather by block table.
QSA layers add one index page per block, addressed by the same block table: pooled block keys
[num_blocks, block_size / r, Di]. Raw index keys are not paged: only the open group's (< r per
sequence) are kept, in the model's recurrent-state slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks of block_size tokens that hold `tokens` tokens."""
    return -(-tokens // block_size)


def usable_blocks(num_blocks: int) -> int:
    """Blocks requests can get out of num_blocks: all but the null block (block 0, which padding
    rows and unused block-table columns point at)."""
    return max(num_blocks - 1, 0)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    index_head_dim: int = 0  # QSA indexer block-key width (0: no index pages)
    index_ratio: int = 1  # tokens pooled into one block key (one key per index_ratio tokens)
    kv_block_size: int = 0  # K/V tokens per page on this rank; 0: block_size (differs under DCP, see parallel/dcp.py)
    kv_dtype: torch.dtype | None = None  # K/V pages only (index pages stay in `dtype`); None: dtype

    def __post_init__(self) -> None:
        if self.index_head_dim and self.block_size % self.index_ratio:
            raise ValueError(
                f"block_size: must be a multiple of the QSA compress ratio {self.index_ratio}, got {self.block_size}"
            )

    @property
    def kv_tokens_per_block(self) -> int:
        return self.kv_block_size or self.block_size

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.kv_dtype or self.dtype

    @property
    def bytes_per_block(self) -> int:
        per_layer = 2 * self.kv_tokens_per_block * self.num_kv_heads * self.head_dim * self.kv_cache_dtype.itemsize
        if self.index_head_dim:  # pooled block keys only
            per_layer += (self.block_size // self.index_ratio) * self.index_head_dim * self.dtype.itemsize
        return self.num_layers * per_layer

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    def num_blocks_for(self, memory_bytes: int) -> int:
        """Blocks a budget of memory_bytes allocates (the null block among them)."""
        return int(memory_bytes // self.bytes_per_block)

    def blocks_for(self, tokens: int) -> int:
        """Blocks one sequence of `tokens` tokens takes (e.g. a max_model_len request)."""
        return blocks_for(tokens, self.block_size)

    def usable_tokens(self, memory_bytes: int) -> int:
        """Tokens requests can hold in a budget of memory_bytes (the null block excluded)."""
        return usable_blocks(self.num_blocks_for(memory_bytes)) * self.block_size


@dataclass
class LayerCache:
    kv: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    block_keys: torch.Tensor | None = None  # [num_blocks, block_size // r, Di]
    k_scale: torch.Tensor | None = None  # 0-d fp32 device tensors, set when kv is FP8 E4M3
    v_scale: torch.Tensor | None = None
    k_offset: torch.Tensor | None = None  # [Hkv, D] fp32 device tensor: keys are stored as k - k_offset (exact for softmax)
    # sees each write's (K, V) [T, Hkv, D] as the pages get them, and the q [T, H, D] the layer attends
    # with (after its transform; under DCP in a QSA layer, the DCP group's heads) (calibration)
    observer: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
    # Head transforms around the pages (quant/kv_rotation.py): the layer multiplies q by q_transform
    # and k by k_transform ([D, D] shared, or [Hkv, D, D] per KV head) before attending; V and the
    # output carry their rotation in the model's folded weights. None: no transform.
    q_transform: torch.Tensor | None = None
    k_transform: torch.Tensor | None = None


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[LayerCache]:
    # Zero-filled so the null block (block 0) holds finite values.
    def zeros(*shape, dtype=spec.dtype):
        return torch.zeros(shape, dtype=dtype, device=device)

    caches = []
    for _ in range(spec.num_layers):
        kv = zeros(2, num_blocks, spec.kv_tokens_per_block, spec.num_kv_heads, spec.head_dim, dtype=spec.kv_cache_dtype)
        cache = LayerCache(kv)
        if spec.index_head_dim:
            cache.block_keys = zeros(num_blocks, spec.block_size // spec.index_ratio, spec.index_head_dim)
        caches.append(cache)
    return caches
