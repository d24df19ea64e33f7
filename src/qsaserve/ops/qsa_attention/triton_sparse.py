"""Triton sparse (selected-token) GQA attention over the paged K/V cache.

Each query row (a decode token, or one token of a multi-token row) attends only to its listed
token positions, read in place from the pages [2, num_blocks, page, Hkv, D] through its
sequence's block table: position p lives at block_table[p // page] * page + p % page. The cost is
the selection's size (budget + r - 1), not the context's.

Grid (row, kv_head, split): the G query heads sharing a KV head form the rows of one Q tile, so
each selected K/V row is loaded once per KV head; the selection is split so that small batches
still fill the GPU, and a second kernel merges the fp32 partials by their base-2 LSE.
FP8 E4M3 pages are converted in registers and their per-tensor scales folded into the scores
(k_scale) and the output (v_scale). Loads are masked with other=0, so padding bytes (NaN under
E4M3) never reach the math. A row with nothing selected gets out = 0 and lse = -inf.

Reference: `reference.sparse_attention_paged_reference`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qsaserve.ops import dcp_merge
from qsaserve.ops.device import num_sms

_LOG2E = 1.4426950408889634
# The running max starts finite so that a tile with no selected token keeps alpha = exp2(0) = 1.
_M_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _tile_slots(idx_row, bt_row, first, end, offs, stride_cb, stride_ct,
                BLOCK_N: tl.constexpr, RUN: tl.constexpr, ALIGN: tl.constexpr, PAGE: tl.constexpr):
    """Cache offsets (in elements) of the tile of listed positions starting at column `first`,
    and which of them are real (columns >= end and -1 entries are not)."""
    n = first + offs
    pos = tl.load(idx_row + n, mask=n < end, other=-1)
    ok = pos >= 0
    if RUN == 1:  # any positions: one block-table read per token
        page = tl.load(bt_row + pos // PAGE, mask=ok, other=0).to(tl.int64)
        tok = page * stride_cb + (pos % PAGE) * stride_ct
    else:
        # Each RUN aligned columns hold positions of one aligned group of RUN tokens (a QSA
        # block, or the open tail's prefix): one block-table read per run, the run's tokens at
        # consecutive slots of that page.
        runs = tl.reshape(pos, [BLOCK_N // RUN, RUN])
        first_pos = tl.max(runs, 1)  # any member locates the group; -1 when the run is empty
        run_page = tl.load(bt_row + first_pos // PAGE, mask=first_pos >= 0, other=0).to(tl.int64)
        run_base = run_page * stride_cb + ((first_pos % PAGE) // RUN * RUN) * stride_ct
        tok = tl.reshape(tl.broadcast_to(run_base[:, None], [BLOCK_N // RUN, RUN]), [BLOCK_N])
        # The reshape hides from the compiler that every token's offset is a multiple of the
        # strides' common factor, which it needs to read K/V rows with 16-byte vectors.
        tok = tl.multiple_of(tok + (pos % RUN) * stride_ct, ALIGN)
    return tok, ok


@triton.jit(do_not_specialize=["M", "stride_bt", "stride_pt", "stride_ph", "stride_lt", "stride_lh"])
def _sparse_kernel(
    q_ptr, kv_ptr, bt_ptr, idx_ptr, seq_ids_ptr, k_scale_ptr, v_scale_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, M,
    stride_qt, stride_qh, stride_c2, stride_cb, stride_ct, stride_ch, stride_bt, stride_it,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, RUN: tl.constexpr,
    ALIGN: tl.constexpr, D: tl.constexpr, D_POW2: tl.constexpr, PAGE: tl.constexpr, HAS_SEQ_IDS: tl.constexpr, FP8: tl.constexpr,
    IEEE: tl.constexpr, PREFETCH: tl.constexpr,
):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if HAS_SEQ_IDS:
        seq = tl.load(seq_ids_ptr + t).to(tl.int64)
    else:
        seq = t.to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    head = kvh * G + rows
    row_ok = rows < G
    d = tl.arange(0, D_POW2)
    d_ok = d < D
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    scale = qk_scale
    if FP8:
        scale = scale * tl.load(k_scale_ptr)

    m_i = tl.full([BLOCK_M], _M_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_POW2], tl.float32)
    offs = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + seq * stride_bt
    idx_row = idx_ptr + t.to(tl.int64) * stride_it
    k_base = kv_ptr + kvh * stride_ch + d[None, :]
    start = split * (TILES * BLOCK_N)
    end = tl.minimum(start + TILES * BLOCK_N, M)
    if PREFETCH:  # the first tile's slots now; each iteration then looks up the next tile's
        tok_next, ok_next = _tile_slots(idx_row, bt_row, start, end, offs, stride_cb, stride_ct,
                                        BLOCK_N, RUN, ALIGN, PAGE)
    for i in range(0, TILES):  # the split's tiles; n < end masks the last one
        if PREFETCH:
            tok, ok = tok_next, ok_next
        else:
            tok, ok = _tile_slots(idx_row, bt_row, start + i * BLOCK_N, end, offs, stride_cb, stride_ct,
                                  BLOCK_N, RUN, ALIGN, PAGE)
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + tok[:, None], mask=kv_mask, other=0.0)
        v = tl.load(k_base + stride_c2 + tok[:, None], mask=kv_mask, other=0.0)
        if PREFETCH:  # index and block-table reads of tile i + 1 overlap tile i's K/V reads and math
            tok_next, ok_next = _tile_slots(idx_row, bt_row, start + (i + 1) * BLOCK_N, end, offs, stride_cb,
                                            stride_ct, BLOCK_N, RUN, ALIGN, PAGE)
        if FP8:  # E4M3 -> the query dtype is exact; the scales are applied outside the dots
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = tl.where(ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if FP8:
        o = o * tl.load(v_scale_ptr)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    o_ptrs = part_o_ptr + t.to(tl.int64) * stride_pt + head[:, None] * stride_ph + split * stride_ps + d[None, :]
    tl.store(o_ptrs, o, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(part_lse_ptr + t.to(tl.int64) * stride_lt + head * stride_lh + split, lse, mask=row_ok)


MERGE_BLOCK_D = 64  # head-dim columns a merge program adds up


@triton.jit(do_not_specialize=["S", "stride_pt", "stride_ph", "stride_lt", "stride_lh", "stride_oj", "stride_ot",
                               "stride_sj", "stride_st"])
def _merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, lse_ptr, S, HL,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_oj, stride_ot, stride_oh, stride_sj, stride_st, stride_sh,
    S_POW2: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (t, h, c): row t, head h, head-dim columns c * BLOCK_D..: at a decode step's one row
    the (t, h) grid alone was 16-32 programs, each reading all splits' partials (~7 us a layer for
    qwen4exp-small at batch 1, more than the attention itself); the lse is stored by c == 0."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    hj = (h // HL).to(tl.int64)  # the output is [J, T, HL, ...]: head h goes to block h // HL (J = 1 unpacked)
    hh = h % HL
    s = tl.arange(0, S_POW2)
    s_ok = s < S
    lses = tl.load(part_lse_ptr + t.to(tl.int64) * stride_lt + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lses, 0)
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    w = tl.where(lses > float("-inf"), tl.exp2(lses - m_safe), 0.0)  # empty splits weigh exactly 0
    total = tl.sum(w, 0)
    d = c * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    o = tl.load(part_o_ptr + t.to(tl.int64) * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                mask=(s_ok & (w > 0.0))[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + hj * stride_oj + t.to(tl.int64) * stride_ot + hh * stride_oh + d, out, mask=d_ok)
    tl.store(lse_ptr + hj * stride_sj + t.to(tl.int64) * stride_st + hh * stride_sh,
             tl.where(total > 0.0, m_safe + tl.log2(total), float("-inf")), mask=c == 0)


@dataclass(frozen=True)
class SparseConfig:
    """Launch parameters. block_n tokens per tile (each K and V tile is block_n x head_dim);
    programs_per_sm: how many resident programs per SM the split heuristic plans for (more splits
    put more K/V bytes in flight at small batch, but each split writes an fp32 partial that the
    merge reads back)."""

    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    programs_per_sm: int = 2
    prefetch: bool = False  # look up tile i + 1's slots while tile i's K/V are read

    def __post_init__(self):
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n: must be a power of two >= 16, got {self.block_n}")
        if self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm: must be >= 1, got {self.programs_per_sm}")


def _align(*strides: int) -> int:
    """Largest power of two (<= 16) dividing every stride: what token offsets are multiples of."""
    a = 16
    while any(x % a for x in strides):
        a //= 2
    return a


def default_config(head_dim: int) -> SparseConfig:
    """Small head dims keep 4 warps and take wider tiles; head_dim 256 tiles of 32 x 256 use 8."""
    return SparseConfig(block_n=64, num_warps=4) if head_dim <= 128 else SparseConfig()


def num_splits(rows: int, kv_heads: int, width: int, num_sms: int, block_n: int = 32, programs_per_sm: int = 2) -> int:
    """Splits of a row's selection so that rows * kv_heads * splits ~ programs_per_sm per SM
    (each split keeps at least one block_n tile). Shapes only: no data-dependent grid."""
    tiles = max(1, triton.cdiv(width, block_n))
    return max(1, min(tiles, triton.cdiv(programs_per_sm * num_sms, max(1, rows * kv_heads))))


def sparse_attention_paged_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_positions: torch.Tensor,
    scale: float | None = None,
    seq_ids: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    splits: int | None = None,
    run: int = 1,
    config: SparseConfig | None = None,
    pack: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [T, Hq, D]; kv_cache [2, num_blocks, page, Hkv, D] (model dtype or FP8 E4M3 with 0-d fp32
    k_scale / v_scale device tensors); block_tables [B, max_blocks]; token_positions [T, M]
    (positions in the row's sequence, -1 = none); seq_ids [T] (row -> block table row; default
    row t is sequence t). Returns fp32 out [T, Hq, D] and base-2 lse [T, Hq].

    run > 1 promises that every `run` aligned columns of token_positions hold positions of one
    aligned group of `run` tokens (or -1), as the QSA selection does with run = r: the kernel then
    reads the block table once per run. With one split the kernel writes out/lse directly (no
    merge launch).

    pack = D > 0 (decode context parallelism's all-to-all merge): returns (packed, None) instead,
    packed [D, T, Hq / D, D_head + 1] as `dcp_merge.pack_partials(out, lse, D)` lays it out (block j
    holds the heads rank j merges, the lse in the last column), written by the split merge itself."""
    t, hq, d = q.shape
    hkv = kv_cache.shape[3]
    if hq % hkv:
        raise ValueError(f"q: {hq} heads is not a multiple of the cache's {hkv} KV heads")
    if kv_cache.shape[-1] != d:
        raise ValueError(f"kv_cache: head dim {kv_cache.shape[-1]} != q's {d}")
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("k_scale: an fp8_e4m3 KV cache needs its layer's k_scale and v_scale")
    cfg = config or default_config(d)
    if run < 1 or run & (run - 1) or kv_cache.shape[2] % run or cfg.block_n % run:
        raise ValueError(f"run: must be a power of two dividing the page ({kv_cache.shape[2]}) and block_n "
                         f"({cfg.block_n}), got {run}")
    scale = d ** -0.5 if scale is None else scale
    m = token_positions.shape[1]
    if pack and hq % pack:
        raise ValueError(f"pack: {hq} query heads do not split over {pack} ranks")
    if t == 0:
        if pack:
            return torch.empty((pack, 0, hq // pack, d + 1), dtype=torch.float32, device=q.device), None
        return (torch.empty((0, hq, d), dtype=torch.float32, device=q.device),
                torch.empty((0, hq), dtype=torch.float32, device=q.device))
    if q.stride(-1) != 1:
        q = q.contiguous()
    token_positions = token_positions.contiguous()
    block_n = cfg.block_n
    s = splits or num_splits(t, hkv, m, num_sms(q.device), block_n, cfg.programs_per_sm)
    chunk = triton.cdiv(triton.cdiv(max(m, 1), s), block_n) * block_n
    s = max(1, triton.cdiv(m, chunk))
    if s == 1 or not pack:  # packed split partials go straight from part_o to the packed layout
        out = torch.empty((t, hq, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((t, hq), dtype=torch.float32, device=q.device)
    if s == 1:  # the kernel's result is final: write it in place
        part_o, part_lse = out[:, :, None, :], lse[:, :, None]
    else:
        part_o = torch.empty((t, hq, s, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((t, hq, s), dtype=torch.float32, device=q.device)
    group = hq // hkv
    d_pow2 = max(16, triton.next_power_of_2(d))
    ids = seq_ids if seq_ids is not None else token_positions  # dummy pointer when unused
    ks = k_scale if fp8 else part_o  # dummy pointers when unused
    vs = v_scale if fp8 else part_o
    _sparse_kernel[(t, hkv, s)](
        q, kv_cache, block_tables, token_positions, ids, ks, vs, part_o, part_lse,
        scale * _LOG2E, m,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), token_positions.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        G=group, BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, TILES=chunk // block_n, RUN=run,
        ALIGN=_align(kv_cache.stride(1), kv_cache.stride(2)),
        D=d, D_POW2=d_pow2,
        PAGE=kv_cache.shape[2], HAS_SEQ_IDS=seq_ids is not None, FP8=fp8, IEEE=q.dtype == torch.float32,
        PREFETCH=cfg.prefetch, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if s == 1:
        return (dcp_merge.pack_partials(out, lse, pack), None) if pack else (out, lse)
    # The merge writes [J, T, Hq / J, ...] blocks: J = pack into the packed layout (lse in its last
    # column), J = 1 into out / lse themselves.
    if pack:
        packed = torch.empty((pack, t, hq // pack, d + 1), dtype=torch.float32, device=q.device)
        dst_o, dst_lse = packed, packed[..., d]
    else:
        dst_o, dst_lse = out[None], lse[None]
    block_d = min(d_pow2, MERGE_BLOCK_D)
    _merge_kernel[(t, hq, triton.cdiv(d, block_d))](
        part_o, part_lse, dst_o, dst_lse, s, dst_o.shape[2],
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        *dst_o.stride()[:3], *dst_lse.stride(),
        S_POW2=triton.next_power_of_2(s), D=d, BLOCK_D=block_d, num_warps=4,
    )
    return (packed, None) if pack else (out, lse)


__all__ = ["SparseConfig", "default_config", "sparse_attention_paged_triton", "num_splits"]


def warm_up(kv_cache: torch.Tensor, num_q_heads: int, q_dtype: torch.dtype, width: int, *, k_scale=None,
            v_scale=None, run: int = 1, pack: int = 0) -> int:
    """Builds every variant of the sparse kernel (and its merge) that a step over kv_cache with
    selections `width` wide can launch: the split count, and with it the tile count per split and
    the merge's width, follows the step's row count, so each distinct one is launched once here,
    with and without seq ids (prefill and decode). Rows select nothing (-1), so only the null
    block's table entry is read; outputs are scratch. Returns the launches made."""
    device, hkv, d = kv_cache.device, kv_cache.shape[3], kv_cache.shape[-1]
    cfg = default_config(d)
    sms = num_sms(device)
    seen, launches = set(), 0
    for rows in range(1, triton.cdiv(cfg.programs_per_sm * sms, hkv) + 2):
        s = num_splits(rows, hkv, width, sms, cfg.block_n, cfg.programs_per_sm)
        chunk = triton.cdiv(triton.cdiv(max(width, 1), s), cfg.block_n) * cfg.block_n
        s = max(1, triton.cdiv(width, chunk))
        if (chunk, s) in seen:
            continue
        seen.add((chunk, s))
        q = torch.zeros((rows, num_q_heads, d), dtype=q_dtype, device=device)
        tables = torch.zeros((rows, 1), dtype=torch.int32, device=device)
        positions = torch.full((rows, width), -1, dtype=torch.long, device=device)
        for seq_ids in (None, torch.arange(rows, dtype=torch.int32, device=device)):
            sparse_attention_paged_triton(q, kv_cache, tables, positions, None, seq_ids, k_scale, v_scale, run=run,
                                          pack=pack)
            launches += 1
    return launches
