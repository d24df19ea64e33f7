"""The QSA indexer over paged caches: pooled block keys live in pages beside the KV cache,
addressed by the same block table. Raw index keys are never paged: each completed group of r raw
keys is pooled into its block key exactly once, when its last token arrives, and the raw keys of
a sequence's open group (< r of them) wait in its recurrent-state slot (`tails`).

Prefill (`select_prefill_tokens`): one sequence's chunk of queries in row blocks that bound the
temporaries, scores through the block table (`prefill_index_scores` here, the Triton kernel in
triton_score.py on CUDA), batched top-k on device with the lowest-index tie rule, or the
reference's per-query torch.topk when transformers' CPU tie order must be reproduced.

The batched decode helpers at the end take one query per sequence and only device tensors (no
per-sequence loop, no host syncs, shapes fixed by the block table width), so a decode step can be
captured in a CUDA graph; `decode_index_scores` is the reference of the Triton scoring kernel."""
from __future__ import annotations

import math

import torch

from qsaserve.ops.qsa_indexer.reference import (apply_partial_rope, index_scores, pool_block_keys, rms_norm_one_centred,
                                                rope_cos_sin, select_tokens)


def pool_chunk_groups(
    tail: torch.Tensor,
    raw: torch.Tensor,
    start: int,
    block_key_cache: torch.Tensor,
    block_table: torch.Tensor,
    k_layernorm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    ratio: int,
    eps: float,
) -> None:
    """Pool the groups that one sequence's chunk (raw keys `raw` [T, Di] at positions
    start..start+T-1) completes, and keep the raw keys of its open group in `tail`.

    tail [r, Di]: the sequence's state row; row j holds the raw key of the latest position
    p = j (mod r), as the decode step (`pool_completed_groups`) leaves it, so rows
    0..start % r - 1 are the open group before this chunk and, on return, rows 0..end % r - 1 the
    open group after it. Raw keys are read from nowhere else, so only r of them are ever stored per
    sequence. block_key_cache [num_blocks, page // r, Di]."""
    keep = start % ratio
    keys_in = torch.cat([tail[:keep], raw.to(tail.dtype)]) if keep else raw.to(tail.dtype)
    first = start // ratio  # keys_in[0] is the first token of group `first`
    done = keys_in.shape[0] // ratio
    if done:
        keys = pool_block_keys(keys_in[: done * ratio], k_layernorm_weight, inv_freq, ratio, eps, first_block=first)
        gpp = block_key_cache.shape[1]
        groups = torch.arange(first, first + done, device=raw.device)
        rows = block_table.long()[groups // gpp] * gpp + groups % gpp
        block_key_cache.view(-1, block_key_cache.shape[-1]).index_copy_(0, rows, keys.to(block_key_cache.dtype))
    n = min(keys_in.shape[0], ratio)  # keys_in[i] is at a position = i (mod r): the last r go to rows i % r
    rows = torch.arange(keys_in.shape[0] - n, keys_in.shape[0], device=raw.device) % ratio
    tail[rows] = keys_in[keys_in.shape[0] - n:]


def prefill_index_scores(
    index_q: torch.Tensor, block_key_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
    ratio: int, num_groups: int,
) -> torch.Tensor:
    """Reference of the Triton prefill scoring kernel: [Tq, num_groups] fp32 scores of one
    sequence's queries (index_q [Tq, Hi, Di] at `positions` [Tq]) over its groups 0..num_groups-1,
    read through its block table [max_blocks]; -inf for groups a query cannot see. The caller
    bounds Tq (the [Tq, Hi, num_groups] fp32 temporary)."""
    gpp = block_key_cache.shape[1]
    groups = torch.arange(num_groups, device=index_q.device)
    keys = block_key_cache.view(-1, block_key_cache.shape[-1])[block_table.long()[groups // gpp] * gpp + groups % gpp]
    scores = index_scores(index_q, keys)
    visible = groups[None, :] < ((positions.long() + 1) // ratio)[:, None]
    return torch.where(visible, scores, torch.full_like(scores, float("-inf")))


MAX_TEMP_BYTES = 512 << 20  # bound on a prefill selection's per-block temporaries


def prefill_rows_per_block(num_groups: int, heads: int, torch_scores: bool, max_bytes: int = MAX_TEMP_BYTES) -> int:
    """Query rows scored and selected at once so that the temporaries stay under `max_bytes`:
    per (row, group) the fp32 score and the int64 selection keys (~40 B), plus the fp32
    [rows, Hi, groups] products when torch computes the scores."""
    per = 40 + (4 * heads if torch_scores else 0)
    return max(1, max_bytes // max(1, num_groups * per))


def select_prefill_tokens(
    index_q: torch.Tensor,
    block_key_cache: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    budget: int,
    num_groups: int,
    tie_break: str = "lowest_index",
    score_fn=None,
    max_bytes: int = MAX_TEMP_BYTES,
    select_fn=None,
) -> torch.Tensor:
    """Token positions [Tq, budget + r - 1] (-1 padded, the reference's layout) for one
    sequence's chunk of queries (index_q [Tq, Hi, Di] at ascending `positions` [Tq]) whose
    context holds `num_groups` complete groups, all pooled in block_key_cache.

    Queries go in row blocks that bound the temporaries (`prefill_rows_per_block`). "lowest_index"
    stays on device (batched top-k of `select_decode_tokens`, no host syncs); "torch" runs the
    reference's per-query 1-D torch.topk (transformers' tie order on CPU). score_fn: the Triton
    kernel (same contract as `prefill_index_scores`); default the torch reference. select_fn
    ("lowest_index" only): scores and selects a row block in one call (same arguments as
    score_fn plus budget; e.g. `triton_score.select_prefill_rows_triton`)."""
    if tie_break not in ("lowest_index", "torch"):
        raise ValueError(f"tie_break: unknown rule {tie_break!r}")
    tq = index_q.shape[0]
    width = budget + ratio - 1
    out = torch.full((tq, width), -1, dtype=torch.long, device=index_q.device)
    if tq == 0:
        return out
    if select_fn is not None and tie_break != "lowest_index":
        raise ValueError("select_fn: a fused selection implements the lowest_index rule only")
    step = prefill_rows_per_block(num_groups, index_q.shape[1], score_fn is None and select_fn is None, max_bytes)
    if (score_fn or select_fn) and step >= 16:
        # Row blocks of 16: the kernels' row slices start 16-byte aligned (Triton specializes on
        # pointer alignment; blocks at arbitrary offsets would build variants while serving).
        step -= step % 16
    score = score_fn or prefill_index_scores
    for a in range(0, tq, step):
        b = min(tq, a + step)
        pos = positions[a:b]
        if select_fn is not None and num_groups > 0:
            out[a:b] = select_fn(index_q[a:b], block_key_cache, block_table, pos, ratio, num_groups, budget)
            continue
        if num_groups == 0:  # nothing pooled yet: the tail (the query's own tokens) only
            scores = torch.full((b - a, 1), float("-inf"), device=index_q.device)
        else:
            scores = score(index_q[a:b], block_key_cache, block_table, pos, ratio, num_groups)
        if tie_break == "lowest_index":
            out[a:b] = select_decode_tokens(scores, pos, ratio, budget)
        else:
            out[a:b] = select_tokens(scores[:, :max(num_groups, 1)], pos, ratio, budget, "torch")[0]
    return out


# ---- batched decode (one query per sequence; device tensors only, no host syncs) ----
def group_rows(block_tables: torch.Tensor, groups: torch.Tensor, groups_per_page: int) -> torch.Tensor:
    """Rows of the flattened block key cache holding groups [B, N] (>= 0) of each sequence."""
    page = block_tables.long().gather(1, groups // groups_per_page)
    return page * groups_per_page + groups % groups_per_page


def pool_completed_groups(
    tails: torch.Tensor,
    slots: torch.Tensor,
    raw: torch.Tensor,
    block_key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    k_layernorm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    ratio: int,
    eps: float,
) -> None:
    """Decode rows append their raw key (`raw` [B, Di], at `positions` [B]) to their sequence's
    open group in `tails` [num_slots, r, Di] (row `slots` [B], column position % r); a row whose
    token completes the group pools the group into its block key.

    Shapes never depend on the data: every row computes a key, and a row that completes nothing
    (or is not `valid`, e.g. CUDA-graph padding on the scratch slot) writes back the value already
    at its target."""
    di = raw.shape[-1]
    p = positions.long().clamp_min(0)
    tails[slots, p % ratio] = raw.to(tails.dtype)
    group_raw = tails[slots]  # [B, r, Di]: the open group, this token's key included
    done = valid & ((positions.long() + 1) % ratio == 0)
    group = ((p + 1) // ratio - 1).clamp_min(0)
    pooled = rms_norm_one_centred(group_raw.float().mean(dim=1).to(group_raw.dtype), k_layernorm_weight, eps)
    cos, sin = rope_cos_sin(group * ratio, inv_freq, group_raw.dtype)
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


def selection_keys(scores: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """int64 top-k keys [B, N] from scores [B, N]: (fp32 bits << 32) + (2^32 - 1 - group) for
    visible groups, -1 for the rest. Scores of visible groups are sums of ReLUs (>= 0), whose fp32
    bit patterns order like the values; the group term makes every key distinct (ties: lower group
    first, the reference's "lowest_index"), so torch.topk's choice is deterministic on any device.
    The Triton scorers can emit these keys directly (`pack=True`)."""
    n = scores.shape[1]
    groups = torch.arange(n, device=scores.device)
    visible = groups[None, :] < ((positions.long() + 1) // ratio)[:, None]
    bits = (scores.float() + 0.0).contiguous().view(torch.int32).long()  # + 0.0: -0.0 -> +0.0
    return torch.where(visible, (bits << 32) + ((1 << 32) - 1 - groups), torch.full_like(bits, -1))


def build_selection(chosen: torch.Tensor, positions: torch.Tensor, ratio: int, budget: int) -> torch.Tensor:
    """Token positions [B, budget + r - 1] (-1 padded) from the top-k groups `chosen` [B, k]
    (descending key order; a row's first min(visible, k) entries are its real choices): each
    chosen group's tokens ascending, then the open tail. Reference of the Triton build kernel."""
    b, k = chosen.shape
    dev = chosen.device
    pos = positions.long()
    num_visible = (pos + 1) // ratio  # 0 for padding rows (position -1)
    count = num_visible.clamp_max(k)
    tokens = chosen[:, :, None] * ratio + torch.arange(ratio, device=dev)
    real = torch.arange(k, device=dev)[None, :] < count[:, None]
    tokens = torch.where(real[:, :, None], tokens, -1).flatten(1)
    width = budget + ratio - 1
    out = torch.cat([tokens, torch.full((b, width + 1 - k * ratio), -1, dtype=torch.long, device=dev)], dim=1)
    # The tail follows the selected groups' tokens (the reference's layout); unused tail slots land
    # in the extra last column, which is dropped.
    j = torch.arange(ratio - 1, device=dev)
    tail = num_visible[:, None] * ratio + j
    col = torch.where(tail <= pos[:, None], count[:, None] * ratio + j, width)
    out.scatter_(1, col, torch.where(tail <= pos[:, None], tail, -1))
    return out[:, :width]


def select_decode_tokens(scores: torch.Tensor, positions: torch.Tensor, ratio: int, budget: int) -> torch.Tensor:
    """Token positions [B, budget + r - 1] (-1 padded) from decode scores [B, N]: the top
    budget // r visible groups (ties: lower group first, the reference's "lowest_index") in
    descending order, each group's tokens ascending, then the open tail. All on device:
    `selection_keys`, one torch.topk, `build_selection`."""
    k = min(budget // ratio, scores.shape[1])
    chosen = torch.topk(selection_keys(scores, positions, ratio), k, dim=1).indices
    return build_selection(chosen, positions, ratio, budget)
