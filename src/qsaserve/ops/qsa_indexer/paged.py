"""The QSA indexer over paged caches: raw index keys live in pages beside the KV cache, and
each completed group of r raw keys is pooled into a block key exactly once, when its last token
is written. Plain torch; the selection itself is `reference.select_tokens`."""
from __future__ import annotations

import torch

from qsaserve.ops.qsa_indexer.reference import index_scores, pool_block_keys, select_tokens


def slots_for(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_table[positions // block_size].long() * block_size + positions % block_size


def update_block_keys(
    raw_cache: torch.Tensor,
    block_key_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    end: int,
    k_layernorm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    ratio: int,
    eps: float,
) -> None:
    """Pool the groups that this chunk (positions start..end-1) completed.

    raw_cache [num_blocks, block_size, Di]; block_key_cache [num_blocks, block_size // ratio, Di]."""
    first, last = start // ratio, end // ratio  # groups [first, last) end inside this chunk
    if last <= first:
        return
    block_size = raw_cache.shape[1]
    dev = raw_cache.device
    positions = torch.arange(first * ratio, last * ratio, device=dev)
    raw = raw_cache.view(-1, raw_cache.shape[-1])[slots_for(block_table, positions, block_size)]
    keys = pool_block_keys(raw, k_layernorm_weight, inv_freq, ratio, eps, first_block=first)
    group_slots = slots_for(block_table, torch.arange(first, last, device=dev) * ratio, block_size) // ratio
    block_key_cache.view(-1, block_key_cache.shape[-1]).index_copy_(0, group_slots, keys.to(block_key_cache.dtype))


def select_paged(
    index_q: torch.Tensor,
    block_key_cache: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    budget: int,
    tie_break: str = "torch",
) -> torch.Tensor:
    """Token positions each query attends: [Tq, budget + r - 1], -1 padded.

    index_q [Tq, Hi, Di] for one sequence whose queries sit at `positions` (ascending)."""
    block_size = block_key_cache.shape[1] * ratio
    num_groups = (int(positions[-1]) + 1) // ratio
    group_slots = slots_for(block_table, torch.arange(num_groups, device=index_q.device) * ratio, block_size) // ratio
    keys = block_key_cache.view(-1, block_key_cache.shape[-1])[group_slots]
    scores = index_scores(index_q, keys)
    indices, _ = select_tokens(scores, positions, ratio, budget, tie_break)
    return indices
