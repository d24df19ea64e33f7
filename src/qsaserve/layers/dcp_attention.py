"""Attention under decode context parallelism: each rank stores the K/V of the tokens it owns
(parallel/dcp.py says which), attends the DCP group's query heads over that shard, and the
partials are merged so each rank ends with its own heads' exact attention."""
from __future__ import annotations

import torch
from torch import nn

from qsaserve.cache.kv_cache import LayerCache
from qsaserve.layers.attention import AttentionMetadata
from qsaserve.ops.attention.dcp_reference import paged_attention_partial
from qsaserve.ops.attention.reference import write_kv_reference


class DcpAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ctx):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.ctx = ctx
        self.cache: LayerCache | None = None  # bound by the model runner after allocation

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.cache.kv

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq*D] (this rank's heads), k/v: [T, Hkv*D] -> [T, Hq*D]."""
        t, plan = q.shape[0], meta.dcp
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        cache = self.cache
        if cache.observer is not None:  # KV-scale calibration sees every new K/V, owned here or not
            cache.observer(k, v)
        write_kv_reference(k[plan.write_rows], v[plan.write_rows], cache.kv, plan.write_slots, cache.k_scale, cache.v_scale)
        q_group = self.ctx.dcp_gather_heads(q.view(t, self.num_heads, self.head_dim))
        keys = self.ctx.dcp.key_positions(max(plan.local_seq_lens), q.device)
        out, lse = paged_attention_partial(q_group, cache.kv, meta.block_tables, meta.query_lens, meta.seq_lens_list,
                                           plan.local_seq_lens, keys, self.scale, cache.k_scale, cache.v_scale)
        return self.ctx.dcp_merge(out, lse).to(q.dtype).reshape(t, -1)
