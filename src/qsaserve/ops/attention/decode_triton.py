"""Triton split-KV paged decode (flash-decoding): rows of <= decode_qlen_cap query tokens per
sequence, each (sequence, KV head) over `num_splits` splits of its keys, merged by a second kernel.

FP8 E4M3 pages are dequantized in registers: E4M3 -> fp16 (one native instruction per pair; V's
by inline asm on 32-bit words, _e4m3_to_f16_asm) is exact, and the per-tensor scales are folded
into the scores (k_scale: q is pre-scaled in fp16) and the normalized output (v_scale), so the math
is that of x * scale with fp32 accumulation and fp32 split partials. FP8 decode has its own launch
config (configs.DECODE_CONFIG_FP8).

CUDA-graph contract: a batch where every row decodes builds no host tensor and never syncs;
`max_seq_len` may be a static upper bound of the device lengths (it only sizes the split grid;
splits past a row's true length contribute nothing); a padding row (seq_len 0, null-block table)
yields zeros. Integer arguments that change from step to step (block-table widths, split lengths,
partial-buffer strides, the DCP rank) are `do_not_specialize`, and the int32 metadata pointers take
no alignment specialization, so that serving compiles no new variant when they move.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.attention.configs import MAX_SPLITS, DecodeConfig, decode_config, num_decode_splits
from qsaserve.ops.attention.triton_common import (LOG2E, ShardKeys, _key_position, _M_INIT, check_scales, dcp_args,
                                                  interpreted)
from qsaserve.ops.device import num_sms


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
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * qk
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
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v16, input_precision="ieee")
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
    D: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SEQ_IDS: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """Program (row, head, c): head-dim columns c * BLOCK_D.. of one query row's head, so a batch-1
    step merges over rows x heads x D / BLOCK_D programs, not rows x heads (32 for llama-8b); the
    lse is written by c == 0."""
    prow = tl.program_id(0)
    head = tl.program_id(1)
    c = tl.program_id(2)
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
    d = c * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    acc = tl.zeros([BLOCK_D], tl.float32)
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
        tl.store(lse_ptr + (q_start + j).to(tl.int64) * stride_et + head * stride_eh, lse, mask=c == 0)


MERGE_BLOCK_D = 64  # head-dim columns a merge program adds up


def _v_group(cfg: DecodeConfig, block_m: int, d_pow2: int) -> int:
    """_permute_cols' A for V (0: none). For Q tiles of <= 32 rows the mma layout spreads the
    warps along head_dim in 8-column slices, so a thread's columns are j + 8 * num_warps * r: with
    A = 8 * num_warps they land on d_pow2 / A adjacent channels (sm_90 build, d128, 4 warps: four
    32-bit shared loads per 4 keys instead of 16 byte loads, 128 registers instead of 211). Taller
    tiles already read V in wide loads."""
    a = 8 * cfg.num_warps
    return a if cfg.fp8_permute_v and block_m <= 32 and 2 * a <= d_pow2 else 0


def _maxnreg(cfg: DecodeConfig, block_m: int, d_pow2: int) -> int | None:
    """cfg.maxnreg for the one-token tile at head_dim <= 128, the build it was tuned on (128
    registers, 8 bytes of spill, 4 programs per SM); None for taller tiles and wider heads, which
    shared memory holds to 2 programs per SM anyway and which the cap would make spill (ptxas,
    sm_90a: 1,320 bytes at 64 rows, 1,076 at d256)."""
    return cfg.maxnreg if cfg.maxnreg and block_m <= 16 and d_pow2 <= 128 else None


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
    fp8 = check_scales(kv_cache, k_scale, v_scale)
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
    key_lens, rank, dcp_size, dcp_i = dcp_args(shard, seq_lens)
    ks, vs = (k_scale, v_scale) if fp8 else (seq_lens, seq_lens)
    lse_t, es = (lse, (lse.stride(0), lse.stride(1))) if lse is not None else (out, (0, 0))
    d_pow2 = triton.next_power_of_2(d)
    block_m = decode_block_m(group, qlen_max)
    _decode_kernel[(num_seqs, hkv, num_splits)](
        q, kv_cache, block_tables, seq_lens, key_lens, cu_query_lens, ids, ks, vs, out, lse_t, part_o, part_lse,
        scale * LOG2E, chunk, rank, qlen_max,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1), *es, *ps,
        G=group, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, D=d, D_POW2=d_pow2, PAGE=kv_cache.shape[2],
        HAS_SEQ_IDS=seq_ids is not None, SINGLE_SPLIT=single, IS_FP8=fp8, WRITE_LSE=lse is not None,
        DCP_SIZE=dcp_size, DCP_I=dcp_i, F16_DOT=fp8 and cfg.fp8_dot == "fp16",
        V_GROUP=_v_group(cfg, block_m, d_pow2) if fp8 else 0,
        # The interpreter runs no asm: there the same exact conversion is a cast.
        V_ASM=fp8 and cfg.fp8_dot == "fp16" and cfg.fp8_v_convert == "asm" and not interpreted(_decode_kernel),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({"maxnreg": cap} if (cap := _maxnreg(cfg, block_m, d_pow2)) else {}),
    )
    if not single:
        block_d = min(d_pow2, MERGE_BLOCK_D)
        _merge_kernel[(rows, hq, triton.cdiv(d, block_d))](
            out, lse_t, part_o, part_lse, key_lens, cu_query_lens, ids, chunk, qlen_max,
            out.stride(0), out.stride(1), *es, *ps,
            # One build for every split count (up to MAX_SPLITS): a constexpr that followed the
            # count would compile a new kernel each time a step's batch or context moved it.
            S_POW2=max(MAX_SPLITS, triton.next_power_of_2(num_splits)), S_BLOCK=16,
            D=d, BLOCK_D=block_d, HAS_SEQ_IDS=seq_ids is not None, WRITE_LSE=lse is not None,
            num_warps=2,
        )
    return out
