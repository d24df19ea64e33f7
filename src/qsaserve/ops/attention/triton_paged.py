"""Triton paged attention: KV cache write, split-KV decode (flash-decoding) and varlen causal prefill.

Cache layout per layer: [2, num_blocks, block_size, Hkv, D] (K then V) in bf16/fp16/fp32 or FP8
E4M3 (`torch.float8_e4m3fn`, per-layer 0-d fp32 k_scale / v_scale, see quant/fp8.py); block 0 is
the null block that pads block tables. Every cache load is masked (other=0) on the sequence
length, so padding rows, the null block and stale page bytes are never read: they may hold E4M3
NaN bytes (0x7F / 0xFF), and a NaN multiplied by a zero mask would still be NaN.

FP8 pages are dequantized in registers: E4M3 -> fp16 (decode, one native instruction per pair;
V's by inline asm on 32-bit words, _e4m3_to_f16_asm) or -> the query dtype (prefill) is exact,
and the per-tensor scales are folded into the scores
(k_scale; decode pre-scales q in fp16) and the normalized output (v_scale), so the math is that of
x * scale with fp32 accumulation and fp32 split-KV partials. FP8 decode has its own launch config
(DECODE_CONFIG_FP8): a tile of E4M3 is half the bytes, so it takes longer tiles and deeper
buffering to keep as many bytes in flight as bf16.

Decode context parallelism (`ShardKeys`): the pages hold only this rank's interleaved token
shard, so key lengths are the shard's and the causal mask compares global positions; the
kernels then also return the base-2 log-sum-exp so the ranks' partials can be merged.

Nothing here touches CUDA at import time; host-side planning uses only the metadata's host lists.
Integer arguments that change from step to step (block-table widths, split lengths, partial-buffer
strides, the DCP rank) are `do_not_specialize`: Triton would otherwise compile a kernel again, in
the middle of serving, each time such a value moves between "== 1", "multiple of 16" and neither.
The QSA and DCP kernels do the same. Likewise the int32 metadata pointers (block tables, lengths,
query offsets, sequence ids) take no 16-byte-alignment specialization: they are often views at
an offset into a larger buffer, read a scalar at a time, and alignment would only add builds.
CUDA-graph contract (decode): a batch where every row decodes builds no host tensor and never
syncs (no .item()/.tolist()/boolean indexing); `meta.seq_lens_list` may be a static upper bound
of the device `meta.seq_lens` (it only sizes the split grid; splits past a row's true length
contribute nothing); a padding row (seq_len 0, null-block table, slot -1) writes nothing and
yields zeros.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qsaserve.ops.device import num_sms

_LOG2E = 1.4426950408889634
# Online-softmax running max starts finite, so a row that sees only masked keys in a tile keeps
# alpha = exp2(0) = 1 instead of exp2(-inf - -inf) = NaN.
_M_INIT = tl.constexpr(-1.0e30)
_FP8 = torch.float8_e4m3fn
_E4M3_MAX = tl.constexpr(448.0)
_SIGN_BIT = tl.constexpr(-2147483648)  # 0x80000000 as int32
_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (t + M) - M rounds |t| < 2**22 to nearest even


# ----------------------------------------------------------------------------------------------
# KV cache write (reshape_and_cache)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _quantize_e4m3(x, scale):
    """fp32 x -> x / scale clamped to +-448 and rounded to nearest-even on the E4M3 grid, as an
    fp32 value that E4M3 holds exactly (so the final cast cannot round differently). Bit-equal to
    torch's `(x / scale).clamp(-448, 448).to(float8_e4m3fn)`, on every backend."""
    y = tl.math.div_rn(x, tl.broadcast_to(scale, x.shape))  # IEEE division, like torch (`/` is approximate)
    y = tl.minimum(tl.maximum(y, -_E4M3_MAX), _E4M3_MAX)
    bits = y.to(tl.int32, bitcast=True)
    # Spacing of E4M3 values around y: 2**(e - 3) for normals (3 mantissa bits), 2**-9 below 2**-6.
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    ulp = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - e) << 23).to(tl.float32, bitcast=True)
    r = ((y * inv_ulp + _RNE_MAGIC) - _RNE_MAGIC) * ulp  # scaling by powers of two is exact
    return (r.to(tl.int32, bitcast=True) | (bits & _SIGN_BIT)).to(tl.float32, bitcast=True)  # keep -0


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, k_off_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c2, stride_cb, stride_ct, stride_ch,
    H: tl.constexpr, H_POW2: tl.constexpr, D: tl.constexpr, D_POW2: tl.constexpr, PAGE: tl.constexpr,
    IS_FP8: tl.constexpr, HAS_K_OFFSET: tl.constexpr,
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
    if HAS_K_OFFSET:  # K is stored relative to a per-channel offset; softmax does not see it
        k = k.to(tl.float32) - tl.load(k_off_ptr + h * D + d, mask=mask, other=0.0)
    if IS_FP8:
        k = _quantize_e4m3(k.to(tl.float32), tl.load(k_scale_ptr))
        v = _quantize_e4m3(v.to(tl.float32), tl.load(v_scale_ptr))
    dst = cache_ptr + (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct + h * stride_ch + d
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c2, v.to(cache_ptr.dtype.element_ty), mask=mask)


def _check_scales(kv_cache: torch.Tensor, k_scale, v_scale) -> bool:
    """True when the cache is FP8 (then both scales must be 1-element fp32 tensors on its device).
    Checks only host-side metadata: nothing syncs."""
    if kv_cache.dtype != _FP8:
        return False
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(s, torch.Tensor):
            raise ValueError(f"{name}: an fp8_e4m3 KV cache needs its layer's {name} (0-d float32 tensor), got {s!r}")
        if s.numel() != 1 or s.dtype != torch.float32 or s.device != kv_cache.device:
            raise ValueError(f"{name}: must be a 1-element float32 tensor on {kv_cache.device}, "
                             f"got shape {tuple(s.shape)} {s.dtype} on {s.device}")
    return True


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             k_offset: torch.Tensor | None = None) -> None:
    """k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]; slot_mapping: [T] (<0 skips).

    FP8 cache: stores E4M3 of clamp(x / scale, +-448) (scales 0-d fp32 device tensors, read by the
    kernel). k_offset: optional float32 [Hkv, D]; K is stored as (k - k_offset) (then quantized)."""
    t, h, d = k.shape
    if t == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("k, v, kv_cache: the last (head_dim) dimension must be contiguous")
    fp8 = _check_scales(kv_cache, k_scale, v_scale)
    if k_offset is not None:
        if k_offset.shape != (h, d) or k_offset.dtype != torch.float32 or k_offset.device != k.device:
            raise ValueError(f"k_offset: must be float32 [{h}, {d}] on {k.device}, "
                             f"got {tuple(k_offset.shape)} {k_offset.dtype} on {k_offset.device}")
        k_offset = k_offset.contiguous()
    dummy = slot_mapping  # any pointer for the unused arguments
    _write_kv_kernel[(t,)](
        k, v, kv_cache, slot_mapping,
        k_scale if fp8 else dummy, v_scale if fp8 else dummy, k_offset if k_offset is not None else dummy,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        H=h, H_POW2=triton.next_power_of_2(h), D=d, D_POW2=triton.next_power_of_2(d), PAGE=kv_cache.shape[2],
        IS_FP8=fp8, HAS_K_OFFSET=k_offset is not None,
        num_warps=4 if h * d >= 1024 else 1,
    )


# ----------------------------------------------------------------------------------------------
# Key positions under decode context parallelism (DCP_SIZE == 1: local row == position)
# ----------------------------------------------------------------------------------------------
@triton.jit
def _key_position(j, rank, DCP_SIZE: tl.constexpr, DCP_I: tl.constexpr):
    """Global position of this rank's local row j (parallel/dcp.py: DcpGeometry.global_position)."""
    if DCP_SIZE == 1:
        p = j
    else:
        p = (j // DCP_I) * (DCP_SIZE * DCP_I) + rank * DCP_I + j % DCP_I
    return p


@triton.jit
def _local_len(n, rank, DCP_SIZE: tl.constexpr, DCP_I: tl.constexpr):
    """How many of positions [0, n) this rank holds (DcpGeometry.local_len)."""
    if DCP_SIZE == 1:
        m = n
    else:
        rem = n % (DCP_SIZE * DCP_I) - rank * DCP_I
        m = (n // (DCP_SIZE * DCP_I)) * DCP_I + tl.minimum(tl.maximum(rem, 0), DCP_I)
    return m


# ----------------------------------------------------------------------------------------------
# FP8 decode helpers
# ----------------------------------------------------------------------------------------------
@triton.jit
def _scaled_f16(q, qk):
    """q * qk rounded to fp16 (finer than bf16: 2**-11 relative), the score's scales folded in so
    s = dot(q16, k_e4m3) needs no multiply. |q * qk| past fp16's 65504 saturates (no inf, whose
    product with a zero key would be NaN); a NaN query stays NaN. Below 2**-14 the value is an fp16
    subnormal: absolute error <= 2**-25 per channel, times |k| <= 448, i.e. < 2e-3 (log2 units) per
    score at D = 128."""
    x = q.to(tl.float32) * qk
    return tl.where(tl.abs(x) > 65504.0, tl.where(x > 0, 65504.0, -65504.0), x).to(tl.float16)


@triton.jit
def _e4m3_to_f16_asm(x):
    """E4M3 -> fp16 by inline asm, four values (one 32-bit word) per block: two native pair
    conversions, where the compiler's own cast builds each 16-bit pair with a shift and an or.
    The compiler converts in the dot's operand layout, so each word is first gathered from
    shared-memory words with byte permutes."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _permute_cols(x, ROWS: tl.constexpr, A: tl.constexpr, B: tl.constexpr):
    """Column j = a * B + b of x [ROWS, A * B] moves to b * A + a (the inverse swaps A and B).

    Why: P @ V reduces over keys, so mma wants each thread's V values paired along keys, while the
    page stores a key's head_dim contiguously. Reading 8-bit V that way costs one byte per shared
    load. Permuting V's columns (and un-permuting the output once, after the loop) so that the
    D / A channels one thread owns per key are adjacent in memory turns those into 32-bit loads:
    A = 8 * (warps along N) puts the thread's register columns on consecutive channels."""
    return tl.reshape(tl.permute(tl.reshape(x, [ROWS, A, B]), [0, 2, 1]), [ROWS, A * B])


# ----------------------------------------------------------------------------------------------
# Decode: grid (seq, kv_head, split). Rows of the Q tile are (query token j, head g of the group),
# so each K/V tile is loaded once for every query head sharing it and for up to QLEN_MAX tokens.
# Split 0 always runs, so a row with no keys (padding row, empty shard) still gets out 0 and
# lse -inf; later splits past the row's key count return at once and the merge never reads them.
# ----------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["chunk", "dcp_rank", "qlen_max", "stride_bt", "stride_pr", "stride_ph", "stride_lr", "stride_lh"],
            do_not_specialize_on_alignment=[
                "bt_ptr", "seq_lens_ptr", "key_lens_ptr", "cu_q_ptr", "seq_ids_ptr", "k_scale_ptr", "v_scale_ptr"])
def _decode_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, key_lens_ptr, cu_q_ptr, seq_ids_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, lse_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, chunk, dcp_rank, qlen_max,
    stride_qt, stride_qh,
    stride_c2, stride_cb, stride_ct, stride_ch,
    stride_bt, stride_ot, stride_oh, stride_et, stride_eh,
    stride_pr, stride_ph, stride_ps, stride_lr, stride_lh,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, D_POW2: tl.constexpr, PAGE: tl.constexpr,
    HAS_SEQ_IDS: tl.constexpr, SINGLE_SPLIT: tl.constexpr, IS_FP8: tl.constexpr, WRITE_LSE: tl.constexpr,
    DCP_SIZE: tl.constexpr, DCP_I: tl.constexpr, F16_DOT: tl.constexpr, V_GROUP: tl.constexpr,
    V_ASM: tl.constexpr,
):
    idx = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if HAS_SEQ_IDS:
        seq = tl.load(seq_ids_ptr + idx)
    else:
        seq = idx
    seq_len = tl.load(seq_lens_ptr + seq)  # global context length: the causal limit
    if DCP_SIZE == 1:
        key_len = seq_len
    else:
        key_len = tl.load(key_lens_ptr + seq)  # rows of this rank's shard
    start = split * chunk
    if (start >= key_len) & (split > 0):  # past the keys: the merge never reads this split
        return
    end = tl.minimum(start + chunk, key_len)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start

    rows = tl.arange(0, BLOCK_M)
    j = rows // G
    head = kvh * G + rows % G
    row_ok = (j < q_len) & (rows < G * qlen_max)
    q_pos = seq_len - q_len + j  # causal limit of each row
    d = tl.arange(0, D_POW2)
    d_ok = d < D
    q = tl.load(
        q_ptr + (q_start + j).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if IS_FP8:
        qk = qk_scale * tl.load(k_scale_ptr)  # k dequantized in the scores
    else:
        qk = qk_scale
    if F16_DOT:  # FP8 pages: E4M3 -> fp16 is native on sm89+ (-> bf16 goes through fp32)
        q = _scaled_f16(q, qk)
        qk = 1.0

    m_i = tl.full([BLOCK_M], _M_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_POW2], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = cache_ptr + kvh * stride_ch + d[None, :]
    if BLOCK_N % PAGE == 0:  # tiles start at multiples of BLOCK_N (chunk is one): whole pages
        tile_page = offs_n // PAGE
        in_page = (offs_n % PAGE) * stride_ct
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_ok = pos < end
        if BLOCK_N % PAGE == 0:
            page = tl.load(bt_row + n0 // PAGE + tile_page, mask=n_ok, other=0).to(tl.int64)
            tok = page * stride_cb + in_page
        else:
            page = tl.load(bt_row + pos // PAGE, mask=n_ok, other=0).to(tl.int64)
            tok = page * stride_cb + (pos % PAGE) * stride_ct
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + tok[:, None], mask=kv_mask, other=0.0)
        v = tl.load(k_base + stride_c2 + tok[:, None], mask=kv_mask, other=0.0)
        if F16_DOT:
            s = tl.dot(q, tl.trans(k.to(tl.float16)))
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk
        kpos = _key_position(pos, dcp_rank, DCP_SIZE, DCP_I)
        s = tl.where(n_ok[None, :] & (kpos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_GROUP > 0:
            v = _permute_cols(v, BLOCK_N, V_GROUP, D_POW2 // V_GROUP)
        if V_ASM:  # F16_DOT
            v16 = _e4m3_to_f16_asm(v)
        else:
            v16 = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v16)
        m_i = m_new

    if V_GROUP > 0:  # acc columns are in V's permuted order: back to head_dim order
        acc = _permute_cols(acc, BLOCK_M, D_POW2 // V_GROUP, V_GROUP)
    has = l_i > 0.0  # a row may see no key in this split (multi-token causal, empty shard)
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if IS_FP8:
        o = o * tl.load(v_scale_ptr)  # v dequantized in the output
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    if SINGLE_SPLIT:
        o_ptrs = out_ptr + (q_start + j).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if WRITE_LSE:
            tl.store(lse_ptr + (q_start + j).to(tl.int64) * stride_et + head * stride_eh, lse, mask=row_ok)
    else:
        prow = (idx * qlen_max + j).to(tl.int64)
        p_ptrs = part_o_ptr + prow[:, None] * stride_pr + head[:, None] * stride_ph + split * stride_ps + d[None, :]
        tl.store(p_ptrs, o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(part_lse_ptr + prow * stride_lr + head * stride_lh + split, lse, mask=row_ok)


@triton.jit(do_not_specialize=["chunk", "qlen_max", "stride_pr", "stride_ph", "stride_lr", "stride_lh"],
            do_not_specialize_on_alignment=["key_lens_ptr", "cu_q_ptr", "seq_ids_ptr"])
def _merge_kernel(
    out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, key_lens_ptr, cu_q_ptr, seq_ids_ptr, chunk, qlen_max,
    stride_ot, stride_oh, stride_et, stride_eh, stride_pr, stride_ph, stride_ps, stride_lr, stride_lh,
    S_POW2: tl.constexpr, S_BLOCK: tl.constexpr,
    D: tl.constexpr, D_POW2: tl.constexpr, HAS_SEQ_IDS: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    prow = tl.program_id(0)
    head = tl.program_id(1)
    idx = prow // qlen_max
    j = prow % qlen_max
    if HAS_SEQ_IDS:
        seq = tl.load(seq_ids_ptr + idx)
    else:
        seq = idx
    q_start = tl.load(cu_q_ptr + seq)
    if j >= tl.load(cu_q_ptr + seq + 1) - q_start:
        return
    n_active = tl.maximum(tl.cdiv(tl.load(key_lens_ptr + seq), chunk), 1)  # splits the decode kernel wrote
    lse_row = part_lse_ptr + prow.to(tl.int64) * stride_lr + head * stride_lh
    s_all = tl.arange(0, S_POW2)
    m = tl.max(tl.load(lse_row + s_all, mask=s_all < n_active, other=float("-inf")), 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no key anywhere: every weight below is 0
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
    total = tl.sum(w_sum, 0)
    out = acc / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + (q_start + j).to(tl.int64) * stride_ot + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d_ok)
    if WRITE_LSE:
        lse = tl.where(total > 0.0, m + tl.log2(tl.where(total > 0.0, total, 1.0)), float("-inf"))
        tl.store(lse_ptr + (q_start + j).to(tl.int64) * stride_et + head * stride_eh, lse)


# ----------------------------------------------------------------------------------------------
# Prefill: grid (q_head, tile). A tile is BLOCK_M query rows of one sequence; rows are the last
# q_len tokens of the context, so row i sits at position seq_len - q_len + i. Keys before the
# tile's first row are visible to every row and take the unmasked loop.
# ----------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["dcp_rank", "stride_bt"], do_not_specialize_on_alignment=[
    "bt_ptr", "seq_lens_ptr", "key_lens_ptr", "cu_q_ptr", "tiles_ptr", "k_scale_ptr", "v_scale_ptr"])
def _prefill_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, key_lens_ptr, cu_q_ptr, tiles_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, lse_ptr, qk_scale, dcp_rank,
    stride_qt, stride_qh,
    stride_c2, stride_cb, stride_ct, stride_ch,
    stride_bt, stride_ot, stride_oh, stride_et, stride_eh,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, D_POW2: tl.constexpr, PAGE: tl.constexpr,
    IS_FP8: tl.constexpr, WRITE_LSE: tl.constexpr, DCP_SIZE: tl.constexpr, DCP_I: tl.constexpr,
):
    head = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.load(tiles_ptr + 2 * tile)
    m0 = tl.load(tiles_ptr + 2 * tile + 1)
    kvh = head // G
    seq_len = tl.load(seq_lens_ptr + seq)
    if DCP_SIZE == 1:
        key_len = seq_len
    else:
        key_len = tl.load(key_lens_ptr + seq)
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
    if IS_FP8:
        qk = qk_scale * tl.load(k_scale_ptr)
    else:
        qk = qk_scale

    m_i = tl.full([BLOCK_M], _M_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_POW2], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    k_base = cache_ptr + kvh * stride_ch + d[None, :]
    d_mask = d_ok[None, :] | (offs_n[:, None] < 0)  # [BLOCK_N, D_POW2]

    # Key rows [0, full_end) sit before every row's position and inside the key count: no masks.
    full_end = (_local_len(ctx + m0, dcp_rank, DCP_SIZE, DCP_I) // BLOCK_N) * BLOCK_N
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
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    # Diagonal tiles: causal and length masks. Key rows past `hi` lie after every row of the tile.
    hi = tl.minimum(key_len, _local_len(ctx + m0 + BLOCK_M, dcp_rank, DCP_SIZE, DCP_I))
    for n0 in range(full_end, hi, BLOCK_N):
        pos = n0 + offs_n
        n_ok = pos < key_len
        page = tl.load(bt_row + pos // PAGE, mask=n_ok, other=0).to(tl.int64)
        tok = page * stride_cb + (pos % PAGE) * stride_ct
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + tok[:, None], mask=kv_mask, other=0.0)
        v = tl.load(k_base + stride_c2 + tok[:, None], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype))) * qk
        kpos = _key_position(pos, dcp_rank, DCP_SIZE, DCP_I)
        s = tl.where(n_ok[None, :] & (kpos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    if IS_FP8:
        o = o * tl.load(v_scale_ptr)
    o_ptrs = out_ptr + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + (q_start + offs_m).to(tl.int64) * stride_et + head * stride_eh, lse, mask=m_ok)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeConfig:
    """Decode launch parameters. The fp8_* fields apply to FP8 E4M3 pages only:
    fp8_dot "fp16" dequantizes E4M3 tiles to fp16 (one native conversion per pair on sm89+) and
    runs both dots in fp16, q pre-scaled (_scaled_f16); "query" converts to the query dtype (for
    bf16 that goes through fp32, several instructions per value). fp8_permute_v reads V 32 bits per
    key row instead of one byte (_permute_cols). fp8_v_convert (fp16 dots): how V becomes fp16,
    "cast" (the compiler's conversion) or "asm" (_e4m3_to_f16_asm). The block-table load takes one
    pipeline stage, so num_stages 5 double-buffers the K/V tiles and 3 single-buffers them."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    ctas_per_sm: int = 2  # resident programs per SM the split heuristic plans for
    fp8_dot: str = "fp16"
    fp8_permute_v: bool = True
    fp8_v_convert: str = "cast"  # V's E4M3 -> fp16: "cast" or "asm" (_e4m3_to_f16_asm)
    maxnreg: int | None = None  # cap on registers per thread (ptxas .maxnreg): more resident programs per SM
    min_waves: float = 1.0  # the split plan's grid must fill this much of one wave (num_decode_splits)

    def __post_init__(self):
        if self.fp8_dot not in ("fp16", "query"):
            raise ValueError(f"fp8_dot: must be 'fp16' or 'query', got {self.fp8_dot!r}")
        if self.fp8_v_convert not in ("cast", "asm"):
            raise ValueError(f"fp8_v_convert: must be 'cast' or 'asm', got {self.fp8_v_convert!r}")
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n: must be a power of two >= 16, got {self.block_n}")


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


@dataclass(frozen=True)
class ShardKeys:
    """This rank's K/V shard under decode context parallelism (parallel/dcp.py): local row j of a
    sequence sits at global position (j // interleave) * size * interleave + rank * interleave
    + j % interleave, and sequence i has lens[i] local rows (lens_list: the same on the host)."""

    size: int
    rank: int
    interleave: int
    lens: torch.Tensor  # [B] int32, on the device
    lens_list: list[int]


DECODE_CONFIG = DecodeConfig()
# Few (seq, kv_head) pairs (batch 1-2): each program streams a long split; longer tiles keep more
# bytes in flight per SM (H200, B1 128K: 3.77 vs 3.23 TB/s). At B8+ 64-token tiles win.
DECODE_CONFIG_FEW = DecodeConfig(block_n=128, num_warps=4, num_stages=3, ctas_per_sm=1)
FEW_PAIRS = 16
# FP8 pages, any batch (docs/fp8.md, "Decode kernel speed", has the measurements): 128-key tiles
# (half of bf16's bytes, so twice the keys per tile), registers capped at 128 so 4 programs fit per
# SM (see _maxnreg), a split plan that counts 0.95 of a wave as full (batch 8 x 8 KV heads: 8
# splits, 512 programs in 528 slots), and V converted by inline asm on 32-bit words. H200, batch 8,
# 128K, vs the bf16 kernel in the same run: 1.62-1.68x under do_bench, 1.53-1.60x inside a CUDA graph.
DECODE_CONFIG_FP8 = DecodeConfig(block_n=128, num_warps=4, num_stages=3, ctas_per_sm=4, maxnreg=128, min_waves=0.95,
                                fp8_v_convert="asm")
# Candidates the benchmark times side by side (benchmarks/bench_attention.py, section fp8); the GPU
# tests run each against the reference. Each was the default once or was measured and not kept
# (figures in the bench_attention results files; docs/fp8.md summarizes them).
FP8_DECODE_CANDIDATES = {
    "bf16_dot_bn64": DecodeConfig(64, 4, 3, 2, fp8_dot="query", fp8_permute_v=False),
    "f16_bn64_s3": DecodeConfig(64, 4, 3, 4),
    "f16_bn128_s2": DecodeConfig(128, 4, 2, 4),
    "f16_bn128_s2_c3": DecodeConfig(128, 4, 2, 3),
    "f16_bn128_s3": DecodeConfig(128, 4, 3, 3),  # the default before the register cap
    "f16_bn128_s3_c2": DecodeConfig(128, 4, 3, 2),
    "f16_bn128_s4": DecodeConfig(128, 4, 4, 3),
    "f16_bn128_s5": DecodeConfig(128, 4, 5, 3),
    "f16_bn256_s2": DecodeConfig(256, 4, 2, 2),
    "f16_bn256_s3": DecodeConfig(256, 4, 3, 2),
    # Where the FP8 kernel's time goes (3.3-3.5 TB/s vs bf16's 4.3-4.45), neither is it: V read
    # without the column permute runs 1.26x at 128K (the permute earns ~0.3x), and the same tile
    # over 8 warps 0.77x (attention_fp8_h200_2026-11-30_b25eee6.json).
    "f16_bn128_s3_noperm": DecodeConfig(128, 4, 3, 3, fp8_permute_v=False),
    "f16_bn128_s3_w8": DecodeConfig(128, 8, 3, 2),
    # Nsight Compute on the uncapped kernel at 128K (c550cf3): 153 registers a thread hold it to 3
    # programs per SM (18% occupancy, 0.81 eligible warps per scheduler, 73% of DRAM peak; bf16's
    # kernel: 126 registers, 4 programs, 94%). These cap the registers so 4 programs fit.
    "f16_bn128_s3_r128": DecodeConfig(128, 4, 3, 4, maxnreg=128, min_waves=0.95),  # the default before V's asm
    "f16_bn128_s4_r128": DecodeConfig(128, 4, 4, 4, maxnreg=128),
    "f16_bn64_s3_r128": DecodeConfig(64, 4, 3, 4, maxnreg=128),
    # Two warps a program: the same warps per SM in more, smaller programs, each with its own load
    # pipeline (shared memory allows ~5 of the 128-key ones per SM, registers 6).
    "f16_bn128_s3_w2": DecodeConfig(128, 2, 3, 5),
    "f16_bn128_s2_w2": DecodeConfig(128, 2, 2, 6),
    "f16_bn64_s3_w2": DecodeConfig(64, 2, 3, 8),
    # V's E4M3 -> fp16 by inline asm (fp8_v_convert), the default.
    "f16_bn128_s3_r128_asm": DECODE_CONFIG_FP8,
}
# H200, B1 8K causal d128: (128,64,8,3) 323, (128,64,4,3) 359, (128,128,8,3) 364 TF/s; the
# 4-warp config is within noise of the best with 2/3 of its shared memory.
PREFILL_CONFIG = {64: PrefillConfig(128, 64, 4, 3), 128: PrefillConfig(128, 64, 4, 3)}
MAX_SPLITS = 128
MIN_SPLIT_TOKENS = 256


def _prefill_config(head_dim: int) -> PrefillConfig:
    return PREFILL_CONFIG[64] if head_dim <= 64 else PREFILL_CONFIG[128]


def decode_config(pairs: int, fp8: bool = False) -> DecodeConfig:
    if fp8:
        return DECODE_CONFIG_FP8
    return DECODE_CONFIG_FEW if pairs <= FEW_PAIRS else DECODE_CONFIG


def _v_group(cfg: DecodeConfig, block_m: int, d_pow2: int) -> int:
    """_permute_cols' A for V (0: none). For Q tiles of <= 32 rows the mma layout spreads the
    warps along head_dim in 8-column slices, so a thread's columns are j + 8 * num_warps * r: with
    A = 8 * num_warps they land on d_pow2 / A adjacent channels (sm_90 build, d128, 4 warps: four
    32-bit shared loads per 4 keys instead of 16 byte loads, 128 registers instead of 211). Taller
    tiles already read V in wide loads."""
    a = 8 * cfg.num_warps
    return a if cfg.fp8_permute_v and block_m <= 32 and 2 * a <= d_pow2 else 0


def _maxnreg(cfg: DecodeConfig, block_m: int, d_pow2: int) -> int | None:
    """cfg.maxnreg for the one-token tile at head_dim <= 128, the build it was measured on (128
    registers, 8 bytes of spill, 4 programs per SM); None for taller tiles and wider heads, which
    shared memory holds to 2 programs per SM anyway and which the cap would make spill (ptxas,
    sm_90a: 1,320 bytes at 64 rows, 1,076 at d256)."""
    return cfg.maxnreg if cfg.maxnreg and block_m <= 16 and d_pow2 <= 128 else None


@functools.lru_cache(maxsize=4096)
def num_decode_splits(pairs: int, max_len: int, num_sms: int, block_n: int, ctas_per_sm: int = 2,
                      min_waves: float = 1.0) -> int:
    """Splits per (seq, kv_head) so the grid fills the GPU in nearly whole waves.

    Fewest splits whose wave efficiency (programs / slots, over the waves started) is >= 0.9 and
    that fill at least min_waves of one wave; splits stay >= MIN_SPLIT_TOKENS long. Batch 256 at
    2K gets 1 split, batch 1 at 256K (8 kv heads) about 33."""
    limit = max(1, min(MAX_SPLITS, -(-max_len // max(MIN_SPLIT_TOKENS, block_n))))
    slots = num_sms * ctas_per_sm
    best, best_eff = 1, 0.0
    for s in range(1, limit + 1):
        waves = pairs * s / slots
        eff = waves / math.ceil(waves)
        if waves >= min_waves and eff >= 0.9:
            return s
        if eff > best_eff + 1e-9:
            best, best_eff = s, eff
    return best


def _interpreted(kernel) -> bool:
    """True under TRITON_INTERPRET=1, where kernels run in numpy and inline asm cannot."""
    return type(kernel).__name__ == "InterpretedFunction"


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
    max_decode_len: int  # host bound on the decode rows' key counts: sizes the split grid only
    tiles: torch.Tensor | None  # [n, 2] int32 (seq, first query row), heaviest first
    num_tiles: int


def decode_qlen_cap(group: int) -> int:
    """Longest query the decode kernel takes: its Q tile holds group * q_len rows (<= 64)."""
    return max(1, min(16, 64 // group))


def decode_block_m(group: int, qlen_max: int) -> int:
    """The decode kernel's Q tile height: the one-token tile while the rows fit in it, else the
    tile of the longest query it takes. Two sizes, not one per query length, so that a batch's
    varying multi-token rows (a chunked prompt's short tail, speculative tokens) do not each
    compile the kernel again."""
    one = max(16, triton.next_power_of_2(group))
    if group * qlen_max <= one:
        return one
    return max(one, triton.next_power_of_2(group * decode_qlen_cap(group)))


def _make_plan(query_lens: list[int], seq_lens: list[int], group: int, block_m: int, device) -> _Plan:
    """Pure Python over host lists; a tensor is built only for a batch that does not all decode.
    seq_lens may be upper bounds of the true lengths (CUDA-graph capture)."""
    cap = decode_qlen_cap(group)
    dec = [i for i, n in enumerate(query_lens) if 0 < n <= cap]
    pre = [i for i, n in enumerate(query_lens) if n > cap]
    qlen_max = max((query_lens[i] for i in dec), default=1)  # a runtime kernel argument: no rounding needed
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


def _plan(meta, group: int, block_m: int, device, shard: ShardKeys | None = None) -> _Plan:
    # Built once per step and shared by every layer: the metadata object carries the cache.
    cache = meta.__dict__.setdefault("_triton_plans", {})
    key = (group, block_m, shard is not None)
    if key not in cache:
        lens = shard.lens_list if shard is not None else meta.seq_lens_list
        cache[key] = _make_plan(list(meta.query_lens), list(lens), group, block_m, device)
    return cache[key]


def _dcp_args(shard: ShardKeys | None, seq_lens: torch.Tensor):
    """(key_lens tensor, rank, DCP_SIZE, DCP_I) for the kernels."""
    if shard is None or shard.size == 1:
        return seq_lens, 0, 1, 1
    return shard.lens, shard.rank, shard.size, shard.interleave


def paged_decode(
    q, kv_cache, block_tables, seq_lens, cu_query_lens, out, scale, *, num_seqs, max_seq_len, qlen_max=1,
    seq_ids=None, config: DecodeConfig | None = None, num_splits: int | None = None,
    k_scale=None, v_scale=None, lse=None, shard: ShardKeys | None = None,
) -> torch.Tensor:
    """Decode rows (<= qlen_max query tokens per sequence) into `out` [T, Hq, D].

    num_seqs: programs along the batch (len(seq_ids) if given); max_seq_len: a host bound on
    their key counts (context lengths, or shard lengths under `shard`), used only to size the
    split grid. lse: optional [T, Hq] fp32 output of the base-2 log-sum-exp of the scaled scores."""
    _, hq, d = q.shape
    hkv = kv_cache.shape[3]
    fp8 = _check_scales(kv_cache, k_scale, v_scale)
    cfg = config or decode_config(num_seqs * hkv, fp8)
    group = hq // hkv
    if qlen_max > decode_qlen_cap(group):  # the Q tile holds group * qlen_max rows at most (decode_block_m)
        raise ValueError(f"qlen_max: the decode kernel takes queries of <= {decode_qlen_cap(group)} tokens at "
                         f"{group} query heads per KV head, got {qlen_max}")
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = num_decode_splits(num_seqs * hkv, max_seq_len, num_sms(q.device), cfg.block_n, cfg.ctas_per_sm,
                                       cfg.min_waves)
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
    key_lens, rank, dcp_size, dcp_i = _dcp_args(shard, seq_lens)
    ks, vs = (k_scale, v_scale) if fp8 else (seq_lens, seq_lens)
    lse_t, es = (lse, (lse.stride(0), lse.stride(1))) if lse is not None else (out, (0, 0))
    d_pow2 = triton.next_power_of_2(d)
    block_m = decode_block_m(group, qlen_max)
    _decode_kernel[(num_seqs, hkv, num_splits)](
        q, kv_cache, block_tables, seq_lens, key_lens, cu_query_lens, ids, ks, vs, out, lse_t, part_o, part_lse,
        scale * _LOG2E, chunk, rank, qlen_max,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1), *es, *ps,
        G=group, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, D=d, D_POW2=d_pow2, PAGE=kv_cache.shape[2],
        HAS_SEQ_IDS=seq_ids is not None, SINGLE_SPLIT=single, IS_FP8=fp8, WRITE_LSE=lse is not None,
        DCP_SIZE=dcp_size, DCP_I=dcp_i, F16_DOT=fp8 and cfg.fp8_dot == "fp16",
        V_GROUP=_v_group(cfg, block_m, d_pow2) if fp8 else 0,
        # The interpreter runs no asm: there the same exact conversion is a cast.
        V_ASM=fp8 and cfg.fp8_dot == "fp16" and cfg.fp8_v_convert == "asm" and not _interpreted(_decode_kernel),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cap} if (cap := _maxnreg(cfg, block_m, d_pow2)) else {}),
    )
    if not single:
        _merge_kernel[(rows, hq)](
            out, lse_t, part_o, part_lse, key_lens, cu_query_lens, ids, chunk, qlen_max,
            out.stride(0), out.stride(1), *es, *ps,
            # One build for every split count (up to MAX_SPLITS): a constexpr that followed the
            # count would compile a new kernel each time a step's batch or context moved it.
            S_POW2=max(MAX_SPLITS, triton.next_power_of_2(num_splits)), S_BLOCK=16,
            D=d, D_POW2=d_pow2, HAS_SEQ_IDS=seq_ids is not None, WRITE_LSE=lse is not None,
            num_warps=4 if d >= 128 else 2,
        )
    return out


def warm_up(kv_cache: torch.Tensor, num_q_heads: int, q_dtype: torch.dtype, *, k_scale=None, v_scale=None,
            shard_geometry: tuple[int, int, int] | None = None) -> int:
    """Builds the prefill, decode and merge kernel variants a serving step can ask for, so that no
    request waits for a Triton build (0.3-1 s each). CUDA-graph capture builds only the split,
    all-decode variants; eager steps also take one split (short contexts), the FEW/default launch
    configs, the tall Q tile (a chunked prompt's short tail, speculative tokens) and, in a batch that
    mixes prefill and decode rows, the seq-id variants. Reads two null-block rows of `kv_cache`
    (block 0, never allocated), writes only scratch tensors.

    shard_geometry: (size, rank, interleave) under decode context parallelism, whose layers
    take the partial form (fp32 out and LSE). Returns the number of launches."""
    device, d = kv_cache.device, kv_cache.shape[4]
    fp8 = _check_scales(kv_cache, k_scale, v_scale)
    seq_lens = torch.ones(2, dtype=torch.int32, device=device)
    cu_q = torch.arange(3, dtype=torch.int32, device=device)
    tables = torch.zeros((2, 1), dtype=torch.int32, device=device)
    ids = torch.arange(2, dtype=torch.int32, device=device)
    q = torch.zeros((2, num_q_heads, d), dtype=q_dtype, device=device)
    partial = shard_geometry is not None
    out = torch.empty(q.shape, dtype=torch.float32 if partial else q_dtype, device=device)
    lse = torch.empty((2, num_q_heads), dtype=torch.float32, device=device) if partial else None
    shard = ShardKeys(*shard_geometry, seq_lens, [1, 1]) if partial else None
    launches = 0
    group = num_q_heads // kv_cache.shape[3]
    # one query length per Q tile height the kernel can take (decode_block_m)
    tile_qlens = {decode_block_m(group, n): n for n in (1, decode_qlen_cap(group))}.values()
    for cfg in dict.fromkeys((decode_config(1, fp8), decode_config(FEW_PAIRS + 1, fp8))):
        for qlen_max in tile_qlens:
            for splits in (1, 2):
                for seq_ids in (None, ids):
                    paged_decode(q, kv_cache, tables, seq_lens, cu_q, out, 1.0, num_seqs=2, max_seq_len=splits * cfg.block_n,
                                 qlen_max=qlen_max, seq_ids=seq_ids, config=cfg, num_splits=splits,
                                 k_scale=k_scale, v_scale=v_scale, lse=lse, shard=shard)
                    launches += 1
    tiles = torch.zeros((1, 2), dtype=torch.int32, device=device)  # (seq 0, first row 0)
    paged_prefill(q, kv_cache, tables, seq_lens, cu_q, out, 1.0, tiles=tiles, num_tiles=1,
                  k_scale=k_scale, v_scale=v_scale, lse=lse, shard=shard)
    return launches + 1


def paged_prefill(
    q, kv_cache, block_tables, seq_lens, cu_query_lens, out, scale, *, tiles, num_tiles,
    config: PrefillConfig | None = None, k_scale=None, v_scale=None, lse=None, shard: ShardKeys | None = None,
) -> torch.Tensor:
    """Causal attention for the (seq, first row) query tiles in `tiles` into `out` [T, Hq, D]
    (and the base-2 log-sum-exp into `lse` [T, Hq] fp32 when given)."""
    if num_tiles == 0:
        return out
    _, hq, d = q.shape
    hkv = kv_cache.shape[3]
    cfg = config or _prefill_config(d)
    fp8 = _check_scales(kv_cache, k_scale, v_scale)
    key_lens, rank, dcp_size, dcp_i = _dcp_args(shard, seq_lens)
    ks, vs = (k_scale, v_scale) if fp8 else (seq_lens, seq_lens)
    lse_t, es = (lse, (lse.stride(0), lse.stride(1))) if lse is not None else (out, (0, 0))
    _prefill_kernel[(hq, num_tiles)](
        q, kv_cache, block_tables, seq_lens, key_lens, cu_query_lens, tiles, ks, vs, out, lse_t, scale * _LOG2E, rank,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1), *es,
        G=hq // hkv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, D=d, D_POW2=triton.next_power_of_2(d),
        PAGE=kv_cache.shape[2], IS_FP8=fp8, WRITE_LSE=lse is not None, DCP_SIZE=dcp_size, DCP_I=dcp_i,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float, out: torch.Tensor | None = None,
                    decode_config: DecodeConfig | None = None, prefill_config: PrefillConfig | None = None, *,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    lse: torch.Tensor | None = None, shard: ShardKeys | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]. Same contract as paged_attention_reference; `meta` is an
    AttentionMetadata. Short queries (decode, spec-decode verify) take the split-KV decode
    kernel, longer ones the prefill kernel; a mixed batch runs both, each on its own sequences.
    k_scale / v_scale: the layer's scales when the cache is FP8 E4M3. lse / shard: see
    paged_attention_partial."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    hq, d = q.shape[1], q.shape[2]
    group = hq // kv_cache.shape[3]
    pcfg = prefill_config or _prefill_config(d)
    plan = _plan(meta, group, pcfg.block_m, q.device, shard)
    kw = dict(k_scale=k_scale, v_scale=v_scale, lse=lse, shard=shard)
    if plan.num_decode:
        paged_decode(
            q, kv_cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, out, scale,
            num_seqs=plan.num_decode, max_seq_len=plan.max_decode_len, qlen_max=plan.qlen_max,
            seq_ids=plan.decode_ids, config=decode_config, **kw,
        )
    if plan.num_tiles:
        paged_prefill(
            q, kv_cache, meta.block_tables, meta.seq_lens, meta.cu_query_lens, out, scale,
            tiles=plan.tiles, num_tiles=plan.num_tiles, config=pcfg, **kw,
        )
    return out


def paged_attention_partial(q: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float, shard: ShardKeys | None,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [T, Hq, D] over the keys in kv_cache (this rank's shard when `shard` is
    given) as a mergeable partial: out [T, Hq, D] fp32 and the base-2 log-sum-exp [T, Hq] fp32 of
    the scaled scores; a row that sees no key gets out 0 and lse -inf. Same contract as
    dcp_reference.paged_attention_partial."""
    t, hq, d = q.shape
    out = torch.empty((t, hq, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((t, hq), dtype=torch.float32, device=q.device)
    paged_attention(q, kv_cache, meta, scale, out=out, k_scale=k_scale, v_scale=v_scale, lse=lse, shard=shard)
    return out, lse
