"""Triton QSA indexer scoring: decode (one query per sequence) and prefill (one sequence's chunk
of queries) against pooled block keys.

score[b, g] = sum_h relu(q[b, h] . key[b, g]) / sqrt(Di) for the groups g < (pos_b + 1) // r that
the query sees, -inf for every other column. Block keys are read in place through the block
table (block key cache [num_blocks, block_size // r, Di]), never gathered into a copy. The grid
covers every group the block table can address, so its size comes from tensor shapes only (a
CUDA graph can capture it); tiles past a sequence's visible groups just store -inf.

Prefill (`prefill_index_scores_triton`) scores a row block of one sequence's queries per program,
all heads in one dot, over a split of its groups; the caller bounds the rows per call.

Selection takes three launches: the scorer emits int64 top-k keys directly (`pack=True`, the
packing of `paged.selection_keys`), one torch.topk, and `_build_kernel` writes the token list
(`select_decode_tokens_triton`, `select_prefill_rows_triton`).

The plain-torch references are `paged.decode_index_scores`, `paged.prefill_index_scores`,
`paged.selection_keys` and `paged.build_selection`; selection is `paged.select_decode_tokens` /
`paged.select_prefill_tokens`.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from qsaserve.ops import dispatch
from qsaserve.ops.device import aligned16, num_sms
from qsaserve.ops.qsa_indexer import paged
from qsaserve.ops.qsa_indexer.triton_topk import topk_forms, topk_indices


@triton.jit
def _finish(score, g, visible, PACK: tl.constexpr):
    """Scores (-inf where hidden) or, with PACK, `paged.selection_keys`: (fp32 bits << 32) +
    (2^32 - 1 - group), -1 where hidden. score >= 0 and + 0.0 turned -0.0 into +0.0."""
    if PACK:
        key = (score.to(tl.int32, bitcast=True).to(tl.int64) << 32) + (4294967295 - g.to(tl.int64))
        return tl.where(visible, key, -1)
    else:  # an explicit else: compiled Triton checks every reachable return's type
        return tl.where(visible, score, float("-inf"))


@triton.jit
def _hidden(BLOCK: tl.constexpr, PACK: tl.constexpr):
    if PACK:
        return tl.full([BLOCK], -1, tl.int64)
    else:
        return tl.full([BLOCK], float("-inf"), tl.float32)


@triton.jit(do_not_specialize=["N", "stride_bt", "stride_ob"], do_not_specialize_on_alignment=["bt_ptr", "pos_ptr"])
def _score_kernel(
    q_ptr, keys_ptr, bt_ptr, pos_ptr, out_ptr, inv_sqrt_d,
    stride_qb, stride_qh, stride_kb, stride_kr, stride_bt, stride_ob,
    N,
    RATIO: tl.constexpr, GPP: tl.constexpr, H: tl.constexpr, H_POW2: tl.constexpr,
    D: tl.constexpr, D_POW2: tl.constexpr, BLOCK_G: tl.constexpr, IEEE: tl.constexpr, PACK: tl.constexpr,
):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    g = tile * BLOCK_G + tl.arange(0, BLOCK_G)
    in_range = g < N
    visible_groups = (tl.load(pos_ptr + b).to(tl.int32) + 1) // RATIO  # 0 for padding rows (pos -1)
    visible = g < visible_groups
    out_row = out_ptr + b.to(tl.int64) * stride_ob
    if tile * BLOCK_G >= visible_groups:  # nothing visible in this tile
        tl.store(out_row + g, _hidden(BLOCK_G, PACK), mask=in_range)
        return
    h = tl.arange(0, H_POW2)
    d = tl.arange(0, D_POW2)
    d_ok = d < D
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh + d[None, :],
                mask=(h[:, None] < H) & d_ok[None, :], other=0.0)
    page = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + g // GPP, mask=visible, other=0).to(tl.int64)
    key_ptrs = keys_ptr + page[:, None] * stride_kb + (g % GPP)[:, None] * stride_kr + d[None, :]
    keys = tl.load(key_ptrs, mask=visible[:, None] & d_ok[None, :], other=0.0)
    if IEEE:
        dots = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [H_POW2, BLOCK_G] fp32
    else:
        dots = tl.dot(q, tl.trans(keys))
    score = tl.sum(tl.maximum(dots, 0.0), axis=0) * inv_sqrt_d + 0.0  # padded heads add relu(0) = 0
    tl.store(out_row + g, _finish(score, g, visible, PACK), mask=in_range)


def _check_keys(index_q: torch.Tensor, block_key_cache: torch.Tensor) -> None:
    """Both scorers read [.., Di] query heads against [.., Di] block keys of the same dtype, unit stride."""
    d = index_q.shape[-1]
    if block_key_cache.shape[-1] != d:
        raise ValueError(f"block_key_cache: key width {block_key_cache.shape[-1]} != index head dim {d}")
    if index_q.dtype != block_key_cache.dtype:
        raise ValueError(f"index_q: dtype {index_q.dtype} differs from the block key cache's {block_key_cache.dtype}")
    assert block_key_cache.stride(-1) == 1


def decode_index_scores_triton(
    index_q: torch.Tensor, block_key_cache: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
    ratio: int, block_g: int = 64, pack: bool = False,
) -> torch.Tensor:
    """index_q [B, Hi, Di] at `positions` [B] (-1: padding row, sees nothing) -> scores [B, N] fp32,
    N = block_tables.shape[1] * (block_size // r). Same contract as `paged.decode_index_scores`;
    pack=True returns `paged.selection_keys` of those scores (int64) instead."""
    b, h, d = index_q.shape
    _check_keys(index_q, block_key_cache)
    gpp = block_key_cache.shape[1]
    n = block_tables.shape[1] * gpp
    out = torch.empty((b, n), dtype=torch.int64 if pack else torch.float32, device=index_q.device)
    if b == 0 or n == 0:
        return out
    index_q = index_q if index_q.stride(-1) == 1 else index_q.contiguous()
    _score_kernel[(b, triton.cdiv(n, block_g))](
        index_q, block_key_cache, block_tables, positions, out, d ** -0.5,
        index_q.stride(0), index_q.stride(1), block_key_cache.stride(0), block_key_cache.stride(1),
        block_tables.stride(0), out.stride(0), n,
        RATIO=ratio, GPP=gpp, H=h, H_POW2=max(16, triton.next_power_of_2(h)), D=d,
        D_POW2=max(16, triton.next_power_of_2(d)), BLOCK_G=block_g, IEEE=index_q.dtype == torch.float32,
        PACK=pack, num_warps=4,
    )
    return out


# The index pointers (a sequence's table row, a chunk's positions) are often views at any offset:
# specialized on their 16-byte alignment, each offset class built its own variant inside a timed pass
@triton.jit(do_not_specialize=["T", "N", "GROUPS_PER_SPLIT", "tiles", "stride_bt", "stride_ot"],
            do_not_specialize_on_alignment=["bt_ptr", "pos_ptr", "map_ptr"])
def _prefill_score_kernel(
    q_ptr, keys_ptr, bt_ptr, pos_ptr, map_ptr, out_ptr, inv_sqrt_d,
    stride_qt, stride_qh, stride_kb, stride_kr, stride_bt, stride_ot,
    T, N, GROUPS_PER_SPLIT, tiles,
    RATIO: tl.constexpr, GPP: tl.constexpr, H: tl.constexpr, H_POW2: tl.constexpr,
    D: tl.constexpr, D_POW2: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, IEEE: tl.constexpr,
    PACK: tl.constexpr, MAPPED: tl.constexpr,
):
    """Row block rb of one sequence's queries (MAPPED: map_ptr [RB, 3] int32 gives each row block's
    sequence, first row and end row, so the blocks of every sequence of a step share one launch;
    else rows rb * BLOCK_T.. of the one sequence) x the groups of split `split`."""
    rb = tl.program_id(0)
    split = tl.program_id(1)
    if MAPPED:
        seq = tl.load(map_ptr + rb * 3).to(tl.int64)
        row0 = tl.load(map_ptr + rb * 3 + 1)
        row_end = tl.load(map_ptr + rb * 3 + 2)
    else:
        seq = 0
        row0 = rb * BLOCK_T
        row_end = T
    bt_row = bt_ptr + seq * stride_bt
    rows = row0 + tl.arange(0, BLOCK_T)
    row_ok = rows < row_end
    nvis = (tl.load(pos_ptr + rows, mask=row_ok, other=-1).to(tl.int32) + 1) // RATIO  # [BLOCK_T]
    max_vis = tl.max(nvis, 0)  # the rows' last one (positions ascend); keys past it are never read
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_ot
    g_start = split * GROUPS_PER_SPLIT
    g_end = tl.minimum(g_start + GROUPS_PER_SPLIT, N)
    g_seen = tl.minimum(g_end, max_vis)
    # The row block's queries, every head: rows m = t * H_POW2 + h of one [BLOCK_T * H_POW2, D] tile.
    m = tl.arange(0, BLOCK_T * H_POW2)
    q_row = row0 + m // H_POW2
    q_head = m % H_POW2
    d = tl.arange(0, D_POW2)
    d_ok = d < D
    q = tl.load(q_ptr + q_row.to(tl.int64)[:, None] * stride_qt + q_head[:, None] * stride_qh + d[None, :],
                mask=((q_row < row_end) & (q_head < H))[:, None] & d_ok[None, :], other=0.0)
    g0 = tl.arange(0, BLOCK_G)
    for i in range(0, tiles):  # a run-time trip count: one build serves every context length
        g = g_start + i * BLOCK_G + g0
        in_split = g < g_end
        if g_start + i * BLOCK_G < g_seen:  # some row sees a group of this tile
            seen = g < g_seen
            page = tl.load(bt_row + g // GPP, mask=seen, other=0).to(tl.int64)
            keys = tl.load(keys_ptr + page[:, None] * stride_kb + (g % GPP)[:, None] * stride_kr + d[None, :],
                           mask=seen[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                dots = tl.dot(q, tl.trans(keys), input_precision="ieee")  # [BLOCK_T * H_POW2, BLOCK_G] fp32
            else:
                dots = tl.dot(q, tl.trans(keys))
            score = tl.sum(tl.reshape(tl.maximum(dots, 0.0), [BLOCK_T, H_POW2, BLOCK_G]), axis=1) * inv_sqrt_d + 0.0
            visible = g[None, :] < nvis[:, None]
            tl.store(out_rows + g[None, :], _finish(score, g[None, :], visible, PACK),
                     mask=row_ok[:, None] & in_split[None, :])
        else:  # no row sees these
            hidden = tl.broadcast_to(_hidden(BLOCK_G, PACK)[None, :], [BLOCK_T, BLOCK_G])
            tl.store(out_rows + g[None, :], hidden, mask=row_ok[:, None] & in_split[None, :])


def _prefill_launch(index_q, block_key_cache, block_tables, positions, out, num_groups, row_blocks, row_map,
                    ratio, block_g, splits):
    """The scoring launch of `prefill_index_scores_triton` (row_map None: one sequence, block_tables
    its row [max_blocks]) and of `prefill_step_keys_triton` (row_map [row_blocks, 3])."""
    t, h, d = index_q.shape
    h_pow2 = triton.next_power_of_2(h)
    tiles = triton.cdiv(num_groups, block_g)
    if splits is None:
        splits = max(1, min(tiles, triton.cdiv(2 * num_sms(index_q.device), row_blocks)))
    tiles_per_split = triton.cdiv(tiles, splits)
    per_split = tiles_per_split * block_g
    _prefill_score_kernel[(row_blocks, triton.cdiv(num_groups, per_split))](
        index_q, block_key_cache, block_tables, positions, row_map if row_map is not None else positions, out,
        d ** -0.5, index_q.stride(0), index_q.stride(1), block_key_cache.stride(0), block_key_cache.stride(1),
        block_tables.stride(0) if row_map is not None else 0, out.stride(0),
        t, num_groups, per_split, tiles_per_split,
        RATIO=ratio, GPP=block_key_cache.shape[1], H=h, H_POW2=h_pow2, D=d, D_POW2=max(16, triton.next_power_of_2(d)),
        BLOCK_T=_prefill_block_t(h), BLOCK_G=block_g, IEEE=index_q.dtype == torch.float32, PACK=out.dtype == torch.int64,
        MAPPED=row_map is not None, num_warps=8 if d > 64 else 4,
    )


def _prefill_block_t(heads: int) -> int:
    """Query rows per program: BLOCK_T rows x every head make one ~128-row tile of the dot."""
    return max(1, 128 // triton.next_power_of_2(heads))


def prefill_index_scores_triton(
    index_q: torch.Tensor, block_key_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
    ratio: int, num_groups: int, block_g: int = 64, splits: int | None = None, pack: bool = False,
) -> torch.Tensor:
    """One sequence's queries index_q [T, Hi, Di] at ascending `positions` [T] against its groups
    0..num_groups-1 (block_table [max_blocks]) -> scores [T, num_groups] fp32, -inf where a query
    cannot see the group. Same contract as `paged.prefill_index_scores`; pack=True returns
    `paged.selection_keys` of those scores (int64) instead.

    A program scores BLOCK_T rows x every head as one [BLOCK_T * Hi, Di] tile (~128 rows of the
    dot), so each key tile is loaded once per row block, not once per query; the groups are split
    across programs when there are few row blocks."""
    t = index_q.shape[0]
    _check_keys(index_q, block_key_cache)
    if block_table.dim() != 1:
        raise ValueError(f"block_table: one sequence's row [max_blocks] expected, got shape {tuple(block_table.shape)}")
    out = torch.empty((t, num_groups), dtype=torch.int64 if pack else torch.float32, device=index_q.device)
    if t == 0 or num_groups == 0:
        return out
    index_q = index_q if index_q.stride(-1) == 1 else index_q.contiguous()
    row_blocks = triton.cdiv(t, _prefill_block_t(index_q.shape[1]))
    _prefill_launch(index_q, block_key_cache, block_table, positions, out, num_groups, row_blocks, None, ratio,
                    block_g, splits)
    return out


def prefill_step_keys_triton(
    index_q: torch.Tensor, block_key_cache: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
    cu_seqlens: torch.Tensor, query_lens: list[int], num_groups: int, ratio: int, block_g: int = 64,
    splits: int | None = None,
) -> torch.Tensor:
    """The queries of several sequences packed along T (index_q [T, Hi, Di] at `positions` [T],
    ascending inside each sequence; sequence s: rows cu_seqlens[s]..cu_seqlens[s+1] ([S + 1] on
    the device, from 0), query_lens [S] the same on the host, block_tables [S, max_blocks]) ->
    `paged.selection_keys` [T, num_groups] int64 of each row's scores over its own sequence's
    groups, num_groups >= every sequence's complete groups. One launch for all of them: the
    row-block map (each block inside one sequence) is built on the device from cu_seqlens."""
    t = index_q.shape[0]
    _check_keys(index_q, block_key_cache)
    out = torch.empty((t, num_groups), dtype=torch.int64, device=index_q.device)
    if t == 0 or num_groups == 0:
        return out
    index_q = index_q if index_q.stride(-1) == 1 else index_q.contiguous()
    block_t = _prefill_block_t(index_q.shape[1])
    row_blocks = sum(triton.cdiv(n, block_t) for n in query_lens)
    _prefill_launch(index_q, block_key_cache, block_tables, positions, out, num_groups, row_blocks,
                    _row_block_map(cu_seqlens, block_t, row_blocks), ratio, block_g, splits)
    return out


def _row_block_map(cu_seqlens: torch.Tensor, block_t: int, row_blocks: int) -> torch.Tensor:
    """[row_blocks, 3] int32 (sequence, first row, end row) of every BLOCK_T-row block of every
    sequence (cu_seqlens [S + 1]), in row order, computed on the device (no host copy)."""
    cu = cu_seqlens.long()
    blocks = (cu[1:] - cu[:-1] + block_t - 1) // block_t
    ends = torch.cumsum(blocks, 0)
    rb = torch.arange(row_blocks, device=cu.device)
    seq = torch.searchsorted(ends, rb, right=True)
    row0 = cu[seq] + (rb - (ends[seq] - blocks[seq])) * block_t
    return torch.stack([seq, row0, cu[seq + 1]], dim=1).to(torch.int32).contiguous()


@triton.jit(do_not_specialize=["K", "dcp_rank", "stride_cb", "stride_ob"], do_not_specialize_on_alignment=["pos_ptr"])
def _build_kernel(chosen_ptr, pos_ptr, out_ptr, K, dcp_rank, stride_cb, stride_ob,
                  WIDTH: tl.constexpr, RATIO: tl.constexpr, BLOCK_W: tl.constexpr,
                  DCP_SIZE: tl.constexpr, DCP_I: tl.constexpr):
    """One row: columns < count*r take chosen[c // r]*r + c % r, the next (pos+1) - nv*r the tail
    nv*r.., the rest -1 (count = min(nv, K) real choices, nv visible groups). With DCP_SIZE > 1
    each position is then mapped to this rank's local row, -1 where another rank owns it
    (`parallel.dcp.DcpGeometry.localize`, the reference)."""
    b = tl.program_id(0)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    nv = tl.where(pos >= 0, (pos + 1) // RATIO, 0)
    count = tl.minimum(nv, K)
    tail_len = tl.where(pos >= 0, pos + 1 - nv * RATIO, 0)
    for c0 in range(0, WIDTH, BLOCK_W):
        c = c0 + tl.arange(0, BLOCK_W)
        in_block = c < count * RATIO
        grp = tl.load(chosen_ptr + b.to(tl.int64) * stride_cb + c // RATIO, mask=in_block, other=0)
        j = c - count * RATIO
        val = tl.where(in_block, grp * RATIO + c % RATIO, tl.where((j >= 0) & (j < tail_len), nv * RATIO + j, -1))
        if DCP_SIZE > 1:
            mine = (val >= 0) & ((val // DCP_I) % DCP_SIZE == dcp_rank)
            val = tl.where(mine, (val // (DCP_SIZE * DCP_I)) * DCP_I + val % DCP_I, -1)
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + c, val, mask=c < WIDTH)


def build_selection_triton(chosen: torch.Tensor, positions: torch.Tensor, ratio: int, budget: int,
                           dcp=None) -> torch.Tensor:
    """`paged.build_selection` in one launch: chosen [B, k] top-k groups -> [B, budget + r - 1].
    dcp: a `DcpGeometry` to write this rank's local rows instead (its `localize` of the result)."""
    b, k = chosen.shape
    width = budget + ratio - 1
    out = torch.empty((b, width), dtype=torch.long, device=chosen.device)
    if b == 0:
        return out
    chosen = chosen.contiguous()
    block_w = min(1024, triton.next_power_of_2(width))
    size = dcp.size if dcp is not None else 1
    _build_kernel[(b,)](chosen, positions, out, k, dcp.rank if size > 1 else 0, chosen.stride(0), out.stride(0),
                        WIDTH=width, RATIO=ratio, BLOCK_W=block_w, DCP_SIZE=size,
                        DCP_I=dcp.interleave if size > 1 else 1, num_warps=4)
    return out


def select_decode_tokens_triton(
    index_q: torch.Tensor, block_key_cache: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
    ratio: int, budget: int, block_g: int = 64, dcp=None,
) -> torch.Tensor:
    """`paged.select_decode_tokens(decode_index_scores(...))` in three launches: packed keys,
    radix top-k, build. Device tensors only, shapes from tensor shapes (CUDA-graph safe). dcp: a
    `DcpGeometry`, to get this rank's local rows (`dcp.localize` of the selection) from the build."""
    keys = decode_index_scores_triton(index_q, block_key_cache, block_tables, positions, ratio, block_g, pack=True)
    k = min(budget // ratio, keys.shape[1])
    return build_selection_triton(_topk(keys, k, positions, ratio), positions, ratio, budget, dcp)


def select_prefill_rows_triton(
    index_q: torch.Tensor, block_key_cache: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
    ratio: int, num_groups: int, budget: int,
) -> torch.Tensor:
    """A row block of one sequence's prefill queries -> selection, as `select_prefill_tokens`
    with the lowest-index rule (its `select_fn`): packed keys, radix top-k, build."""
    keys = prefill_index_scores_triton(index_q, block_key_cache, block_table, positions, ratio, num_groups, pack=True)
    k = min(budget // ratio, num_groups)
    return build_selection_triton(_topk(keys, k, positions, ratio), positions, ratio, budget)


def select_prefill_step_triton(
    index_q: torch.Tensor, block_key_cache: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
    cu_seqlens: torch.Tensor, spans: list[tuple[int, int]], seq_lens: list[int], ratio: int, budget: int,
    max_bytes: int = paged.MAX_TEMP_BYTES,
) -> torch.Tensor:
    """Every sequence of a step at once (`select_prefill_step`'s lowest-index rule): consecutive
    sequences whose temporaries fit `max_bytes` share one scoring launch over all their rows, one
    top-k and one build; a sequence too long for that alone goes in row blocks
    (`paged.select_prefill_tokens`)."""
    width = budget + ratio - 1
    out = torch.empty((index_q.shape[0], width), dtype=torch.long, device=index_q.device)
    for s0, s1 in _sequence_groups(spans, seq_lens, ratio, max_bytes):
        a, b = spans[s0][0], spans[s1 - 1][1]
        groups = max(seq_lens[s] // ratio for s in range(s0, s1))
        q, pos, tables = aligned16(index_q[a:b]), aligned16(positions[a:b]), aligned16(block_tables[s0:s1])
        if s1 - s0 == 1 and (b - a) * groups * _KEY_BYTES > max_bytes:
            out[a:b] = paged.select_prefill_tokens(q, block_key_cache, tables[0], pos, ratio, budget, groups,
                                                   select_fn=select_prefill_rows_triton)
            continue
        if groups == 0:  # no complete group anywhere yet: every row keeps its own open group only
            chosen = torch.empty((b - a, 0), dtype=torch.long, device=index_q.device)
        else:
            keys = prefill_step_keys_triton(q, block_key_cache, tables, pos, cu_seqlens[s0:s1 + 1] - a,
                                            [e - f for f, e in spans[s0:s1]], groups, ratio)
            chosen = _topk(keys, min(budget // ratio, groups), pos, ratio)
        out[a:b] = build_selection_triton(chosen, pos, ratio, budget)
    return out



_KEY_BYTES = 40  # per (row, group): the int64 key and the top-k's working copies (paged.prefill_rows_per_block)


def _sequence_groups(spans: list[tuple[int, int]], seq_lens: list[int], ratio: int,
                     max_bytes: int) -> list[tuple[int, int]]:
    """Runs [s0, s1) of consecutive sequences whose rows x most groups stay under max_bytes."""
    runs, s0, rows, groups = [], 0, 0, 0
    for s, ((a, b), length) in enumerate(zip(spans, seq_lens)):
        g = max(groups, length // ratio)
        if s > s0 and (rows + b - a) * g * _KEY_BYTES > max_bytes:
            runs.append((s0, s))
            s0, rows, g = s, 0, length // ratio
        rows, groups = rows + b - a, g
    if spans:
        runs.append((s0, len(spans)))
    return runs


def _topk(keys: torch.Tensor, k: int, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """The radix top-k kernel where it is faster, scanning each row's visible groups only, or
    torch.topk (always with QSASERVE_FUSED_KERNELS=0; same indices)."""
    if dispatch.use_triton(keys):
        return topk_indices(keys, k, positions, ratio)
    return torch.topk(keys, k, dim=1).indices




def warm_up(block_key_cache: torch.Tensor, num_heads: int, ratio: int, budget: int, max_groups: int) -> int:
    """Builds the indexer's selection kernels for every width a step can score: the decode and
    prefill scorers (one variant each per model, and the prefill step's row-block map), the
    build, and the top-k per power-of-two bucket of groups up to max_groups (its tile and sort
    width follow the groups a step scores), over each of its launch forms the rows may pick.
    Block 0 (the null block) is the only page read. Returns the launches made."""
    device, di, dtype = block_key_cache.device, block_key_cache.shape[-1], block_key_cache.dtype
    gpp = block_key_cache.shape[1]
    q = torch.zeros((2, num_heads, di), dtype=dtype, device=device)
    positions = torch.full((2,), 2 * gpp * ratio - 1, dtype=torch.long, device=device)
    tables = torch.zeros((2, 2), dtype=torch.int32, device=device)
    select_decode_tokens_triton(q, block_key_cache, tables, positions, ratio, budget)
    select_prefill_rows_triton(q, block_key_cache, tables[0], positions, ratio, 2 * gpp, budget)
    cu = torch.tensor([0, 1, 2], dtype=torch.long, device=device)
    prefill_step_keys_triton(q, block_key_cache, tables, positions, cu, [1, 1], 2 * gpp, ratio)
    launches = 3
    n = 16
    while True:
        k = min(budget // ratio, n)
        keys = torch.full((1, n), -1, dtype=torch.int64, device=device)
        forms = topk_forms(n) if dispatch.use_triton(keys) else (lambda keys, k, **kw: torch.topk(keys, k, dim=1).indices,)
        for form in forms:  # one row builds what any row count of the form runs
            build_selection_triton(form(keys, k, positions=positions[:1], ratio=ratio), positions[:1], ratio, budget)
            launches += 1
        if n >= max_groups:
            return launches
        n *= 2
