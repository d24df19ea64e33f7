"""Attention under decode context parallelism: each rank stores the K/V of the tokens it owns
(parallel/dcp.py says which), attends the DCP group's query heads over that shard, and the
partials are merged so each rank ends with its own heads' exact attention.

The shard attention is ops.attention.paged_attention_partial: fp32 out + base-2 LSE over the
rank's local rows, causal on global positions."""
from __future__ import annotations

import torch
from torch import nn

from qsaserve.cache.kv_cache import LayerCache
from qsaserve.layers.attention import AttentionMetadata, write_layer_kv
from qsaserve.ops import attention as attention_ops
from qsaserve.quant.kv_rotation import rotate_qk


class DcpAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ctx):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.ctx = ctx
        self.cache: LayerCache | None = None  # bound by the model runner after allocation

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.cache.kv

    def warm_up(self, dtype: torch.dtype) -> int:
        """Builds the Triton attention kernels this layer's steps may take (kernel launches made): the
        partial form over the DCP group's query heads."""
        dcp = self.ctx.dcp
        return attention_ops.warm_up(self.cache.kv, self.num_heads * dcp.size, dtype, k_scale=self.cache.k_scale,
                                     v_scale=self.cache.v_scale, shard_geometry=(dcp.size, dcp.rank, dcp.interleave))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq*D] (this rank's heads), k/v: [T, Hkv*D] -> [T, Hq*D]."""
        t, plan = q.shape[0], meta.dcp
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        cache = self.cache
        if cache.k_transform is not None:  # the pages hold transformed K/V (quant/kv_rotation.py); the
            # model's V and output projections carry V's rotation and its inverse (fold_kv_rotation)
            q, k = rotate_qk(q, k, cache.q_transform, cache.k_transform)
        if cache.observer is not None:  # KV-scale calibration sees every new K/V, owned here or not
            cache.observer(k, v, q)
        q_group = self.ctx.dcp_gather_heads(q)
        write_layer_kv(k[plan.write_rows], v[plan.write_rows], cache, plan.write_slots)
        out, lse = attention_ops.paged_attention_partial(q_group, cache.kv, meta, self.scale, self.ctx.dcp,
                                                         cache.k_scale, cache.v_scale)
        out = self.ctx.dcp_merge(out, lse).to(q.dtype)
        return out.reshape(t, -1)
