"""The QSA indexer over paged caches: raw index keys live in pages beside the KV cache, and
each completed group of r raw keys is pooled into a block key exactly once, when its last token
is written. Plain torch; the selection itself is `reference.select_tokens`.

The batched decode helpers at the end take one query per sequence and only device tensors (no
per-sequence loop, no host syncs, shapes fixed by the block table width), so a decode step can be
captured in a CUDA graph; `decode_index_scores` is the reference of the Triton scoring kernel."""
from __future__ import annotations

import math

import torch

from qsaserve.ops.qsa_indexer.reference import (apply_partial_rope, index_scores, pool_block_keys, rms_norm_one_centred,
                                                rope_cos_sin, select_tokens)


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


# ---- batched decode (one query per sequence; device tensors only, no host syncs) ----
def group_rows(block_tables: torch.Tensor, groups: torch.Tensor, groups_per_page: int) -> torch.Tensor:
    """Rows of the flattened block key cache holding groups [B, N] (>= 0) of each sequence."""
    page = block_tables.long().gather(1, groups // groups_per_page)
    return page * groups_per_page + groups % groups_per_page


def pool_completed_groups(
    raw_cache: torch.Tensor,
    block_key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    k_layernorm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    ratio: int,
    eps: float,
) -> None:
    """Decode rows whose token (at `positions` [B]) completes a group pool it into its block key.

    Shapes never depend on the data: every row computes a key, and a row that completes nothing
    (or is not `valid`, e.g. CUDA-graph padding) writes back the value already at its target."""
    block_size, di = raw_cache.shape[1], raw_cache.shape[2]
    p = positions.long().clamp_min(0)
    done = valid & ((positions.long() + 1) % ratio == 0)
    group = ((p + 1) // ratio - 1).clamp_min(0)
    tok = group[:, None] * ratio + torch.arange(ratio, device=p.device)  # [B, r]
    page = block_tables.long().gather(1, tok // block_size)
    raw = raw_cache.view(-1, di)[page * block_size + tok % block_size]  # [B, r, Di]
    pooled = rms_norm_one_centred(raw.float().mean(dim=1).to(raw.dtype), k_layernorm_weight, eps)
    cos, sin = rope_cos_sin(group * ratio, inv_freq, raw.dtype)
    key = apply_partial_rope(pooled, cos, sin)
    flat = block_key_cache.view(-1, di)
    row = group_rows(block_tables, group[:, None], block_key_cache.shape[1])[:, 0]
    flat.index_copy_(0, row, torch.where(done[:, None], key.to(flat.dtype), flat[row]))


def decode_index_scores(
    index_q: torch.Tensor, block_key_cache: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor, ratio: int
) -> torch.Tensor:
    """Reference of the Triton scoring kernel: [B, N] fp32 scores of one query per sequence
    (index_q [B, Hi, Di] at `positions` [B]) over every group its block table can address
    (N = block_tables.shape[1] * groups per page); -inf for groups it cannot see."""
    b, _, di = index_q.shape
    gpp = block_key_cache.shape[1]
    n = block_tables.shape[1] * gpp
    groups = torch.arange(n, device=index_q.device)
    keys = block_key_cache.view(-1, di)[group_rows(block_tables, groups.expand(b, n), gpp)]  # [B, N, Di]
    scores = torch.einsum("bhd,bnd->bhn", index_q.float(), keys.float()).relu().sum(dim=1) / math.sqrt(di)
    visible = groups[None, :] < ((positions.long() + 1) // ratio)[:, None]
    return torch.where(visible, scores, torch.full_like(scores, float("-inf")))


def select_decode_tokens(scores: torch.Tensor, positions: torch.Tensor, ratio: int, budget: int) -> torch.Tensor:
    """Token positions [B, budget + r - 1] (-1 padded) from decode scores [B, N]: the top
    budget // r visible groups (ties: lower group first, the reference's "lowest_index") in
    descending order, each group's tokens ascending, then the open tail. All on device.

    Scores of visible groups are sums of ReLUs (>= 0), whose fp32 bit patterns order like the
    values; packing (bits, -group) into one int64 makes every key distinct, so torch.topk's
    choice is deterministic on any device."""
    b, n = scores.shape
    dev = scores.device
    pos = positions.long()
    num_visible = (pos + 1) // ratio  # 0 for padding rows (position -1)
    groups = torch.arange(n, device=dev)
    visible = groups[None, :] < num_visible[:, None]
    bits = (scores.float() + 0.0).contiguous().view(torch.int32).long()  # + 0.0: -0.0 -> +0.0
    key = torch.where(visible, (bits << 32) + ((1 << 32) - 1 - groups), torch.full_like(bits, -1))
    k = min(budget // ratio, n)
    top, chosen = torch.topk(key, k, dim=1)
    tokens = chosen[:, :, None] * ratio + torch.arange(ratio, device=dev)
    tokens = torch.where((top >= 0)[:, :, None], tokens, -1).flatten(1)
    width = budget + ratio - 1
    out = torch.cat([tokens, torch.full((b, width + 1 - k * ratio), -1, dtype=torch.long, device=dev)], dim=1)
    # The tail follows the selected groups' tokens (the reference's layout); unused tail slots land
    # in the extra last column, which is dropped.
    j = torch.arange(ratio - 1, device=dev)
    tail = num_visible[:, None] * ratio + j
    col = torch.where(tail <= pos[:, None], num_visible.clamp_max(k)[:, None] * ratio + j, width)
    out.scatter_(1, col, torch.where(tail <= pos[:, None], tail, -1))
    return out[:, :width]
