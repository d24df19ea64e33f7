"""Triton paged attention: KV cache write, split-KV decode (flash-decoding) and varlen causal prefill.

Cache layout per layer: [2, num_blocks, block_size, Hkv, D] (K then V); block 0 is the null
block that pads block tables. Every kernel loads cache rows with a mask on the sequence length,
so padding rows and stale page bytes are never read (they may hold NaN once the cache is FP8).

Nothing here touches CUDA at import time; host-side planning uses only the metadata's host lists
(decode never syncs: no .item()/.tolist()/boolean indexing on device tensors).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# Online-softmax running max starts finite, so a row that sees only masked keys in a tile keeps
# alpha = exp2(0) = 1 instead of exp2(-inf - -inf) = NaN.
_M_INIT = tl.constexpr(-1.0e30)


# ----------------------------------------------------------------------------------------------
# KV cache write (reshape_and_cache)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c2, stride_cb, stride_ct, stride_ch,
    H: tl.constexpr, H_POW2: tl.constexpr, D: tl.constexpr, D_POW2: tl.constexpr, PAGE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padded token: nothing to store
        return
    h = tl.arange(0, H_POW2)[:, None]
    d = tl.arange(0, D_POW2)[None, :]
    mask = (h < H) & (d < D)
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    dst = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct + h * stride_ch + d
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c2, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]; slot_mapping: [T] (<0 skips)."""
    t, h, d = k.shape
    if t == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.stride(-1) == 1
    _write_kv_kernel[(t,)](
        k, v, kv_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        H=h, H_POW2=triton.next_power_of_2(h), D=d, D_POW2=triton.next_power_of_2(d), PAGE=kv_cache.shape[2],
        num_warps=4 if h * d >= 1024 else 1,
    )


# ----------------------------------------------------------------------------------------------
# Decode: grid (seq, kv_head, split). Rows of the Q tile are (query token j, head g of the group),
# so each K/V tile is loaded once for every query head sharing it and for up to QLEN_MAX tokens.
# ----------------------------------------------------------------------------------------------
@triton.jit
def _decode_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, cu_q_ptr, seq_ids_ptr,
    out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, chunk,
    stride_qt, stride_qh,
    stride_c2, stride_cb, stride_ct, stride_ch,
    stride_bt, stride_ot, stride_oh,
    stride_pr, stride_ph, stride_ps, stride_lr, stride_lh,
    G: tl.constexpr, QLEN_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, D_POW2: tl.constexpr, PAGE: tl.constexpr,
    HAS_SEQ_IDS: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
):
    idx = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if HAS_SEQ_IDS:
        seq = tl.load(seq_ids_ptr + idx)
    else:
        seq = idx
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * chunk
    if start >= seq_len:  # this split lies past the sequence; the merge never reads it
        return
    end = tl.minimum(start + chunk, seq_len)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start

    rows = tl.arange(0, BLOCK_M)
    j = rows // G
    head = kvh * G + rows % G
    row_ok = (j < q_len) & (rows < G * QLEN_MAX)
    q_pos = seq_len - q_len + j  # causal limit of each row
    d = tl.arange(0, D_POW2)
    d_ok = d < D
    q = tl.load(
        q_ptr + (q_start + j).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )

    m_i = tl.full([BLOCK_M], _M_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_POW2], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = cache_ptr + kvh * stride_ch + d[None, :]
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_ok = pos < end
        page = tl.load(bt_row + pos // PAGE, mask=n_ok, other=0).to(tl.int64)
        tok = page * stride_cb + (pos % PAGE) * stride_ct
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + tok[:, None], mask=kv_mask, other=0.0)
        v = tl.load(k_base + stride_c2 + tok[:, None], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
        s = tl.where(n_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    has = l_i > 0.0  # a row may see no key in this split (multi-token causal)
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if SINGLE_SPLIT:
        o_ptrs = out_ptr + (q_start + j).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        prow = (idx * QLEN_MAX + j).to(tl.int64)
        p_ptrs = part_o_ptr + prow[:, None] * stride_pr + head[:, None] * stride_ph + split * stride_ps + d[None, :]
        tl.store(p_ptrs, o, mask=row_ok[:, None] & d_ok[None, :])
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + prow * stride_lr + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    out_ptr, part_o_ptr, part_lse_ptr, seq_lens_ptr, cu_q_ptr, seq_ids_ptr, chunk,
    stride_ot, stride_oh, stride_pr, stride_ph, stride_ps, stride_lr, stride_lh,
    QLEN_MAX: tl.constexpr, S_POW2: tl.constexpr, S_BLOCK: tl.constexpr,
    D: tl.constexpr, D_POW2: tl.constexpr, HAS_SEQ_IDS: tl.constexpr,
):
    prow = tl.program_id(0)
    head = tl.program_id(1)
    idx = prow // QLEN_MAX
    j = prow % QLEN_MAX
    if HAS_SEQ_IDS:
        seq = tl.load(seq_ids_ptr + idx)
    else:
        seq = idx
    q_start = tl.load(cu_q_ptr + seq)
    if j >= tl.load(cu_q_ptr + seq + 1) - q_start:
        return
    n_active = tl.cdiv(tl.load(seq_lens_ptr + seq), chunk)  # splits the decode kernel wrote
    lse_row = part_lse_ptr + prow.to(tl.int64) * stride_lr + head * stride_lh
    s_all = tl.arange(0, S_POW2)
    m = tl.max(tl.load(lse_row + s_all, mask=s_all < n_active, other=float("-inf")), 0)
    d = tl.arange(0, D_POW2)
    d_ok = d < D
    acc = tl.zeros([D_POW2], tl.float32)
    w_sum = tl.zeros([S_BLOCK], tl.float32)
    o_row = part_o_ptr + prow.to(tl.int64) * stride_pr + head * stride_ph
    for s0 in range(0, n_active, S_BLOCK):
        s = s0 + tl.arange(0, S_BLOCK)
        s_ok = s < n_active
        w = tl.where(s_ok, tl.exp2(tl.load(lse_row + s, mask=s_ok, other=float("-inf")) - m), 0.0)
        o = tl.load(o_row + s[:, None] * stride_ps + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
        w_sum += w
    out = acc / tl.sum(w_sum, 0)
    tl.store(out_ptr + (q_start + j).to(tl.int64) * stride_ot + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)


# ----------------------------------------------------------------------------------------------
# Prefill: grid (q_head, tile). A tile is BLOCK_M query rows of one sequence; rows are the last
# q_len tokens of the context, so row i sits at position seq_len - q_len + i. Keys before the
# tile's first row are visible to every row and take the unmasked loop.
# ----------------------------------------------------------------------------------------------
@triton.jit
def _prefill_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, cu_q_ptr, tiles_ptr, out_ptr, qk_scale,
    stride_qt, stride_qh,
    stride_c2, stride_cb, stride_ct, stride_ch,
    stride_bt, stride_ot, stride_oh,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, D_POW2: tl.constexpr, PAGE: tl.constexpr,
):
    head = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.load(tiles_ptr + 2 * tile)
    m0 = tl.load(tiles_ptr + 2 * tile + 1)
    kvh = head // G
    seq_len = tl.load(seq_lens_ptr + seq)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    ctx = seq_len - q_len

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < q_len
    q_pos = ctx + offs_m
    d = tl.arange(0, D_POW2)
    d_ok = d < D
    q = tl.load(
        q_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=m_ok[:, None] & d_ok[None, :], other=0.0,
    )

    m_i = tl.full([BLOCK_M], _M_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_POW2], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = cache_ptr + kvh * stride_ch + d[None, :]
    d_mask = d_ok[None, :] | (offs_n[:, None] < 0)  # [BLOCK_N, D_POW2]

    # Keys [0, full_end) are < every row's position and < seq_len: no masks.
    full_end = ((ctx + m0) // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        pos = n0 + offs_n
        page = tl.load(bt_row + pos // PAGE).to(tl.int64)
        tok = page * stride_cb + (pos % PAGE) * stride_ct
        if D == D_POW2:
            k = tl.load(k_base + tok[:, None])
            v = tl.load(k_base + stride_c2 + tok[:, None])
        else:
            k = tl.load(k_base + tok[:, None], mask=d_mask, other=0.0)
            v = tl.load(k_base + stride_c2 + tok[:, None], mask=d_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    # Diagonal tiles: causal and length masks.
    hi = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
    for n0 in range(full_end, hi, BLOCK_N):
        pos = n0 + offs_n
        n_ok = pos < seq_len
        page = tl.load(bt_row + pos // PAGE, mask=n_ok, other=0).to(tl.int64)
        tok = page * stride_cb + (pos % PAGE) * stride_ct
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + tok[:, None], mask=kv_mask, other=0.0)
        v = tl.load(k_base + stride_c2 + tok[:, None], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk_scale
        s = tl.where(n_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    ctas_per_sm: int = 2  # resident programs per SM the split heuristic plans for


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


DECODE_CONFIG = DecodeConfig()
# Few (seq, kv_head) pairs (batch 1-2): each program streams a long split; longer tiles keep more
# bytes in flight per SM (H200, B1 128K: 3.77 vs 3.23 TB/s). At B8+ 64-token tiles win.
DECODE_CONFIG_FEW = DecodeConfig(block_n=128, num_warps=4, num_stages=3, ctas_per_sm=1)
FEW_PAIRS = 16
# H200, B1 8K causal d128: (128,64,8,3) 323, (128,64,4,3) 359, (128,128,8,3) 364 TF/s; the
# 4-warp config is within noise of the best with 2/3 of its shared memory.
PREFILL_CONFIG = {64: PrefillConfig(128, 64, 4, 3), 128: PrefillConfig(128, 64, 4, 3)}
MAX_SPLITS = 128
MIN_SPLIT_TOKENS = 256


def _prefill_config(head_dim: int) -> PrefillConfig:
    return PREFILL_CONFIG[64] if head_dim <= 64 else PREFILL_CONFIG[128]


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # interpreter runs: any plausible value
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_config(pairs: int) -> DecodeConfig:
    return DECODE_CONFIG_FEW if pairs <= FEW_PAIRS else DECODE_CONFIG


@functools.lru_cache(maxsize=4096)
def num_decode_splits(pairs: int, max_len: int, num_sms: int, block_n: int, ctas_per_sm: int = 2) -> int:
    """Splits per (seq, kv_head) so the grid fills the GPU in nearly whole waves.

    Fewest splits whose wave efficiency (programs / slots, over the waves started) is >= 0.9 and
    that fill at least one wave; splits stay >= MIN_SPLIT_TOKENS long. Batch 256 at 2K gets 1
    split, batch 1 at 256K (8 kv heads) about 33."""
    limit = max(1, min(MAX_SPLITS, -(-max_len // max(MIN_SPLIT_TOKENS, block_n))))
    slots = num_sms * ctas_per_sm
    best, best_eff = 1, 0.0
    for s in range(1, limit + 1):
        waves = pairs * s / slots
        eff = waves / math.ceil(waves)
        if waves >= 1.0 and eff >= 0.9:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


def _host_int32(values: list[int], device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":  # pinned + non_blocking: the copy is queued, the host does not wait
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class _Plan:
    decode_ids: torch.Tensor | None  # None: every sequence decodes, program i is sequence i
    num_decode: int
    qlen_max: int
    max_decode_len: int
    tiles: torch.Tensor | None  # [n, 2] int32 (seq, first query row), heaviest first
    num_tiles: int


def decode_qlen_cap(group: int) -> int:
    """Longest query the decode kernel takes: its Q tile holds group * q_len rows (<= 64)."""
    return max(1, min(16, 64 // group))


def _make_plan(query_lens: list[int], seq_lens: list[int], group: int, block_m: int, device) -> _Plan:
    cap = decode_qlen_cap(group)
    dec = [i for i, n in enumerate(query_lens) if 0 < n <= cap]
    pre = [i for i, n in enumerate(query_lens) if n > cap]
    qlen_max = triton.next_power_of_2(max((query_lens[i] for i in dec), default=1))
    max_dec = max((seq_lens[i] for i in dec), default=0)
    decode_ids = None if len(dec) == len(query_lens) else (_host_int32(dec, device) if dec else None)
    tiles = []
    for i in pre:
        for m0 in range(0, query_lens[i], block_m):
            tiles.append((seq_lens[i] - query_lens[i] + m0, i, m0))
    tiles.sort(reverse=True)  # most keys first: long programs start early, short ones fill the tail
    flat = [x for _, i, m0 in tiles for x in (i, m0)]
    tiles_t = _host_int32(flat, device).view(-1, 2) if tiles else None
    return _Plan(decode_ids, len(dec), qlen_max, max_dec, tiles_t, len(tiles))


def _plan(meta, group: int, block_m: int, device) -> _Plan:
    # Built once per step and shared by every layer: the metadata object carries the cache.
    cache = meta.__dict__.setdefault("_triton_plans", {})
    key = (group, block_m)
    if key not in cache:
        cache[key] = _make_plan(list(meta.query_lens), list(meta.seq_lens_list), group, block_m, device)
    return cache[key]


def paged_decode(
    q, kv_cache, block_tables, seq_lens, cu_query_lens, out, scale, *, num_seqs, max_seq_len, qlen_max=1,
    seq_ids=None, config: DecodeConfig | None = None, num_splits: int | None = None,
) -> torch.Tensor:
    """Decode rows (<= qlen_max query tokens per sequence) into `out` [T, Hq, D].

    num_seqs: programs along the batch (len(seq_ids) if given); max_seq_len: a host bound on
    their context lengths, used only to size the split grid."""
    _, hq, d = q.shape
    hkv = kv_cache.shape[3]
    cfg = config or decode_config(num_seqs * hkv)
    group = hq // hkv
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = num_decode_splits(num_seqs * hkv, max_seq_len, _num_sms(q.device), cfg.block_n, cfg.ctas_per_sm)
    chunk = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), cfg.block_n) * cfg.block_n
    num_splits = triton.cdiv(max(max_seq_len, 1), chunk)
    single = num_splits == 1
    rows = num_seqs * qlen_max
    if single:
        part_o = part_lse = out  # unused
        ps = (0, 0, 0, 0, 0)
    else:
        part_o = torch.empty((rows, hq, num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((rows, hq, num_splits), dtype=torch.float32, device=q.device)
        ps = (part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1))
    ids = seq_ids if seq_ids is not None else seq_lens  # dummy pointer when unused
    d_pow2 = triton.next_power_of_2(d)
    _decode_kernel[(num_seqs, hkv, num_splits)](
        q, kv_cache, block_tables, seq_lens, cu_query_lens, ids, out, part_o, part_lse,
        scale * _LOG2E, chunk,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1), *ps,
        G=group, QLEN_MAX=qlen_max, BLOCK_M=max(16, triton.next_power_of_2(group * qlen_max)),
        BLOCK_N=cfg.block_n, D=d, D_POW2=d_pow2, PAGE=kv_cache.shape[2],
        HAS_SEQ_IDS=seq_ids is not None, SINGLE_SPLIT=single,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not single:
        _merge_kernel[(rows, hq)](
            out, part_o, part_lse, seq_lens, cu_query_lens, ids, chunk,
            out.stride(0), out.stride(1), *ps,
            QLEN_MAX=qlen_max, S_POW2=triton.next_power_of_2(num_splits), S_BLOCK=min(16, triton.next_power_of_2(num_splits)),
            D=d, D_POW2=d_pow2, HAS_SEQ_IDS=seq_ids is not None,
            num_warps=4 if d >= 128 else 2,
        )
    return out


def paged_prefill(
    q, kv_cache, block_tables, seq_lens, cu_query_lens, out, scale, *, tiles, num_tiles,
    config: PrefillConfig | None = None,
) -> torch.Tensor:
    """Causal attention for the (seq, first row) query tiles in `tiles` into `out` [T, Hq, D]."""
    if num_tiles == 0:
        return out
    _, hq, d = q.shape
    hkv = kv_cache.shape[3]
    cfg = config or _prefill_config(d)
    _prefill_kernel[(hq, num_tiles)](
        q, kv_cache, block_tables, seq_lens, cu_query_lens, tiles, out, scale * _LOG2E,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        G=hq // hkv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D=d, D_POW2=triton.next_power_of_2(d),
        PAGE=kv_cache.shape[2], num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float, out: torch.Tensor | None = None,
                    decode_config: DecodeConfig | None = None, prefill_config: PrefillConfig | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. Same contract as paged_attention_reference; `meta` is an
    AttentionMetadata. Short queries (decode, spec-decode verify) take the split-KV decode
    kernel, longer ones the prefill kernel; a mixed batch runs both, each on its own sequences."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    hq, d = q.shape[1], q.shape[2]
    group = hq // kv_cache.shape[3]
    pcfg = prefill_config or _prefill_config(d)
    plan = _plan(meta, group, pcfg.block_m, q.device)
    if plan.num_decode:
        paged_decode(
            q, kv_cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, out, scale,
            num_seqs=plan.num_decode, max_seq_len=plan.max_decode_len, qlen_max=plan.qlen_max,
            seq_ids=plan.decode_ids, config=decode_config,
        )
    if plan.num_tiles:
        paged_prefill(
            q, kv_cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, out, scale,
            tiles=plan.tiles, num_tiles=plan.num_tiles, config=pcfg,
        )
    return out
