"""Attention layer and the per-step metadata the model runner hands to every attention layer.

The layer writes this step's K/V into the paged cache, then attends over each sequence's
whole context. ops.attention chooses the implementation (Triton kernels on GPU, the torch
reference on CPU); models only see this module.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from qsaserve.cache.kv_cache import LayerCache
from qsaserve.ops import attention as attention_ops
from qsaserve.ops.head_transform import rotate_qk


def write_layer_kv(k: torch.Tensor, v: torch.Tensor, cache: LayerCache, slots: torch.Tensor) -> None:
    """A layer's K/V [T, Hkv, D] into its pages at slots [T], with its FP8 scales and K offset (if any)."""
    attention_ops.write_kv(k, v, cache.kv, slots, cache.k_scale, cache.v_scale, k_offset=cache.k_offset)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with the null block
    seq_lens: torch.Tensor  # [B] int32: context length after this step
    cu_query_lens: torch.Tensor  # [B+1] int32
    query_lens: list[int]  # host copies, for the reference backend and planning
    seq_lens_list: list[int]
    state_slots: list[int]  # recurrent-state slot of each sequence (hybrid models)
    dcp: object = None  # parallel.dcp.DcpStepPlan under decode context parallelism, else None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.cache: LayerCache | None = None  # bound by the model runner after allocation

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.cache.kv

    def warm_up(self, dtype: torch.dtype) -> int:
        """Builds the Triton attention kernels this layer's steps may take (kernel launches made)."""
        return attention_ops.warm_up(self.cache.kv, self.num_heads, dtype, k_scale=self.cache.k_scale,
                                     v_scale=self.cache.v_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq*D], k/v: [T, Hkv*D] -> [T, Hq*D]."""
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        cache = self.cache
        if cache.k_transform is not None:  # the pages hold transformed K/V (quant/kv_rotation.py); the
            # model's V and output projections carry V's rotation and its inverse (fold_kv_rotation)
            q, k = rotate_qk(q, k, cache.q_transform, cache.k_transform)
        if cache.observer is not None:
            cache.observer(k, v, q)
        write_layer_kv(k, v, cache, meta.slot_mapping)
        out = attention_ops.paged_attention(q, cache.kv, meta, self.scale, k_scale=cache.k_scale, v_scale=cache.v_scale)
        return out.reshape(t, self.num_heads * self.head_dim)

    def takes_written_kv(self, dtype: torch.dtype) -> bool:
        """Whether a projection may write this step's K/V [T, Hkv, D] in `dtype` into the pages
        itself (then forward_written): plain pages of that dtype, no head transform, K offset or
        observer between the projection and the pages."""
        cache = self.cache
        return (cache is not None and cache.kv.dtype == dtype and cache.k_scale is None and cache.k_offset is None
                and cache.k_transform is None and cache.observer is None)

    def forward_written(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq*D] -> [T, Hq*D], attending over pages that already hold this step's K/V
        (written with the projection: takes_written_kv)."""
        t = q.shape[0]
        out = attention_ops.paged_attention(q.view(t, self.num_heads, self.head_dim), self.cache.kv, meta, self.scale)
        return out.reshape(t, self.num_heads * self.head_dim)
