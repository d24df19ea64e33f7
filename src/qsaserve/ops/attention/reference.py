"""Plain-torch paged attention: the reference every attention kernel is tested against.

One entry point covers prefill, chunked prefill over a cached prefix, and decode: each
sequence's new queries attend causally over its whole context, read from pages through its
block table. Math in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]; slot_mapping: [T]."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_context(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `length` tokens of one sequence's K and V: [length, Hkv, D] each."""
    block_size = kv_cache.shape[2]
    blocks = block_table[: -(-length // block_size)].long()
    k = kv_cache[0, blocks].flatten(0, 1)[:length]
    v = kv_cache[1, blocks].flatten(0, 1)[:length]
    return k, v


def paged_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D] (sequences concatenated); seq_lens[i] counts sequence i's context
    including its query_lens[i] new tokens, which are its last ones. Returns [T, Hq, D]."""
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    out = torch.empty_like(q)
    start = 0
    for i, (n, length) in enumerate(zip(query_lens, seq_lens)):
        qi = q[start : start + n].float().transpose(0, 1)  # [Hq, n, D]
        k, v = gather_context(kv_cache, block_tables[i], length)
        k = k.float().transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, dim=0)
        v = v.float().transpose(0, 1).repeat_interleave(num_heads // num_kv_heads, dim=0)
        # Query j sits at position length - n + j and sees keys 0..that position.
        mask = torch.arange(length, device=q.device)[None, :] <= torch.arange(length - n, length, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
        out[start : start + n] = o.transpose(0, 1).to(q.dtype)
        start += n
    return out
