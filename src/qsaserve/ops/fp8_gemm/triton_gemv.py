"""FP8-weight GEMV for decode at 1-4 rows: y [M, N] = x [M, K] @ W^T with W E4M3 [N, K] and
float32 scales [Sn, Sk] (reference.py's layout). No tl.dot (which pads M to 16 rows): each program
streams BLOCK_N weight rows, BLOCK_K columns an iteration, as E4M3 (1 byte a weight: the step's
whole cost), widens them to float32 in registers and multiplies them by every row of x (FMA),
so the weights are read once for all rows.

A tile is [BLOCK_K / 128, BLOCK_N, 128], groups first: Triton then lays each thread over several
weight rows of the same columns, so one widened x value serves them all (sm_90 SASS of the 16 x
512 loop at one row, the next tile carried in registers: 404 instructions an iteration against
491 with rows first). Each 128-column
group is reduced first and then scaled by its block scale (one multiply per row and group, not
per weight); per-channel / per-tensor scales (Sk == 1) are applied once to the finished sums.
Scales are gathered per weight row, scale[n // block_n, k // 128], so any block_n works, also one
that does not divide the tile. The K loop is software-pipelined (num_stages: cp.async into shared
memory, more weight bytes in flight a program without holding them in registers): 296
instructions an iteration (64 weights a thread), where carrying the next tile in registers took
404, repacking its E4M3 bytes. Not yet timed on a GPU.

The grid is one program per BLOCK_N rows (pick_gemv_tile) and, with split_k > 1, split_k programs
per row block over contiguous whole-128-column ranges of K, whose float32 partial sums
triton_gemm's _split_k_sum_kernel adds in a fixed order: deterministic, no atomics, no host sync
(CUDA-graph safe)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.device import num_sms
from qsaserve.ops.fp8_gemm.reference import GROUP
from qsaserve.ops.fp8_gemm.triton_gemm import _scale_k_stride, split_k_buffer, sum_split_k, w8a16_operands

MAX_ROWS = 4  # rows of x one pass over the weights serves
PART_ROWS: tl.constexpr = tl.constexpr(4)  # the partial sums of squares' row stride
PART_BLOCK = 256  # partial sums the prenormed GEMV adds at a time
TILE_BYTES = 16384  # E4M3 bytes a program loads an iteration at one row (16 x 1024); half at more rows


@triton.jit
def _row_input(x_ptr, r, M, stride_xm, kk, k_ok, K, GATED: tl.constexpr):
    """Row r of the input at columns kk [G, 128] as float32 (zeros past K and for r >= M). GATED:
    x holds gate | up (2K columns) and the input is SiLU(gate) * up, rounded to x's dtype where
    ops.fused.silu_mul rounds (after the SiLU, after the product)."""
    ok = k_ok & (r < M)
    if GATED:
        dt = x_ptr.dtype.element_ty
        gate = tl.load(x_ptr + r * stride_xm + kk, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + r * stride_xm + K + kk, mask=ok, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        return (act * up).to(dt).to(tl.float32)
    return tl.load(x_ptr + r * stride_xm + kk, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _norm_row_input(x_ptr, res_ptr, g_ptr, sum_ptr, r, M, stride_xm, kk, k_ok, ss, HAS_RES: tl.constexpr,
                    store_sum):
    """Row r of the block output x (+ the residual) at columns kk [G, 128] for a GEMV whose input is
    RMSNorm(x + residual) * g: returns (the sum, rounded to x's dtype as the residual stream is,
    times g, float32; ss [G, 128] + the sum's squares, elementwise: reduced once after the loop, not
    across threads every tile). store_sum: this program writes the sum (the next residual) to
    sum_ptr."""
    ok = k_ok & (r < M)
    dt = x_ptr.dtype.element_ty
    v = tl.load(x_ptr + r * stride_xm + kk, mask=ok, other=0.0)
    if HAS_RES:
        v = (v.to(tl.float32) + tl.load(res_ptr + r * stride_xm + kk, mask=ok, other=0.0).to(tl.float32)).to(dt)
        tl.store(sum_ptr + r * stride_xm + kk, v, mask=ok & store_sum)
    v = v.to(tl.float32)
    g = tl.load(g_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
    return v * g, ss + v * v


@triton.jit
def _row_step(acc, ss, x_ptr, res_ptr, g_ptr, sum_ptr, r, M, stride_xm, kk, k_ok, K, w, s, first,
              ROW_SCALE: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """One K tile of row r: (acc [G, BLOCK_N] + the row's input (_row_input, or _norm_row_input
    under NORM) times the tile w, ss [G, 128] + its squares under NORM)."""
    if NORM:
        xr, ss = _norm_row_input(x_ptr, res_ptr, g_ptr, sum_ptr, r, M, stride_xm, kk, k_ok, ss, HAS_RES, first)
    else:
        xr = _row_input(x_ptr, r, M, stride_xm, kk, k_ok, K, GATED)
    return _scaled_partial(acc, xr, w, s, ROW_SCALE), ss


@triton.jit
def _scaled_partial(acc, xr, w, s, ROW_SCALE: tl.constexpr):
    """acc [G, BLOCK_N] + the tile w [G, BLOCK_N, 128] times the row input xr [G, 128], summed
    per 128-column group (scaled by the block scales s unless ROW_SCALE)."""
    part = tl.sum(w * xr[:, None, :], 2)
    if not ROW_SCALE:
        part = part * s
    return acc + part


@triton.jit
def split_k_range(y_ptr, K, stride_ys, GROUP_: tl.constexpr, SPLIT_K: tl.constexpr):
    """The GEMVs' K range and output base (FP8 and NVFP4): everything with one split, else
    program pid_k takes the scale groups [pid_k * ng // SPLIT_K, (pid_k + 1) * ng // SPLIT_K) of
    ng = ceil(K / GROUP_) (sizes differ by at most one; a program may get none) and writes plane
    pid_k of the [SPLIT_K, M, N] partials. -> (k_lo, k_hi, y_base)."""
    if SPLIT_K == 1:
        return 0, K, y_ptr
    pid_k = tl.program_id(1)
    ng = tl.cdiv(K, GROUP_)
    k_lo = (pid_k * ng // SPLIT_K) * GROUP_
    k_hi = tl.minimum(((pid_k + 1) * ng // SPLIT_K) * GROUP_, K)
    return k_lo, k_hi, y_ptr + pid_k.to(tl.int64) * stride_ys


@triton.jit
def store_rows(y_base, n, n_ok, rs, M, stride_ym, acc0, acc1, acc2, acc3, ROWS: tl.constexpr):
    """The GEMVs' epilogue (FP8 and NVFP4): row r's per-group sums acc_r [G, BLOCK_N] summed over
    the groups, times the row scales rs [BLOCK_N], stored at y_base + r * stride_ym + n in y's
    dtype; rows >= M (the 4-row variant run for 3) are not stored."""
    ty = y_base.dtype.element_ty
    out = y_base + n
    tl.store(out, (tl.sum(acc0, 0) * rs).to(ty), mask=n_ok)
    if ROWS > 1:
        tl.store(out + stride_ym, (tl.sum(acc1, 0) * rs).to(ty), mask=n_ok & (1 < M))
    if ROWS > 2:
        tl.store(out + 2 * stride_ym, (tl.sum(acc2, 0) * rs).to(ty), mask=n_ok & (2 < M))
        tl.store(out + 3 * stride_ym, (tl.sum(acc3, 0) * rs).to(ty), mask=n_ok & (3 < M))


@triton.jit
def _residual_row(acc, rs, r, M, n, n_ok, res_ptr, g_ptr, h_ptr, hg_ptr, part_ptr, stride_m):
    """RESIDUAL_OUT's epilogue for row r: the block output (acc [G, BLOCK_N] summed, times the row
    scales rs, rounded to the residual's dtype as a stored output is) plus the residual, rounded:
    h, stored; h times the next RMSNorm's weight g, stored in the same dtype (hg); and the sum of
    h's squares over this program's columns, stored at part_ptr[program, r]."""
    ok = n_ok & (r < M)
    ty = h_ptr.dtype.element_ty
    out = (tl.sum(acc, 0) * rs).to(ty).to(tl.float32)
    h = (out + tl.load(res_ptr + r * stride_m + n, mask=ok, other=0.0).to(tl.float32)).to(ty)
    tl.store(h_ptr + r * stride_m + n, h, mask=ok)
    hf = tl.where(ok, h.to(tl.float32), 0.0)
    g = tl.load(g_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(hg_ptr + r * stride_m + n, (hf * g).to(ty), mask=ok)
    tl.store(part_ptr + tl.program_id(0) * PART_ROWS + r, tl.sum(hf * hf, 0), mask=r < M)


@triton.jit
def _inv_rms(part_ptr, n_parts, r, K, eps, PART_BLOCK: tl.constexpr):
    """PRENORMED: 1 / rms of row r from the producer's n_parts per-program sums of squares,
    PART_BLOCK at a time (one build for any producer; a fixed order: deterministic)."""
    p = tl.arange(0, PART_BLOCK)
    ss = tl.zeros((PART_BLOCK,), dtype=tl.float32)
    for p0 in range(0, n_parts, PART_BLOCK):
        ss += tl.load(part_ptr + (p0 + p) * PART_ROWS + r, mask=p0 + p < n_parts, other=0.0)
    return tl.rsqrt(tl.sum(ss, 0) / K + eps)


@triton.jit
def _rope_kv_row(acc, rs, r, M, n, n_ok, y_ptr, stride_ym, head, p0, pos_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr,
                 stride_cos, stride_c2, stride_cb, stride_ct, stride_ch, n_q_heads, n_kv_heads, page,
                 BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """ROPE_KV's epilogue for row r of a fused q | k | v projection: the output rounded to y's
    dtype; in the q and k heads rotated (rotate-half RoPE at the row's position: this program's
    BLOCK_N // 2 channel pairs (d, d + HALF), d from p0, come interleaved, so a pair is two
    neighbours) and rounded again, as ops.fused.rope_qk rotates the stored output; stored to y; and
    in the k and v heads written to the row's slot of the paged cache [2, blocks, page, Hkv, D]
    (slot < 0: not written), as ops.attention.write_kv stores them."""
    PAIRS: tl.constexpr = BLOCK_N // 2
    ok = n_ok & (r < M)
    ty = y_ptr.dtype.element_ty
    out = (tl.sum(acc, 0) * rs).to(ty)
    pos = tl.load(pos_ptr + r, mask=r < M, other=0).to(tl.int64)
    d = p0 + tl.arange(0, PAIRS)
    c = tl.load(cos_ptr + pos * stride_cos + d).to(tl.float32)
    sn = tl.load(sin_ptr + pos * stride_cos + d).to(tl.float32)
    x1, x2 = tl.split(tl.reshape(out.to(tl.float32), (PAIRS, 2)))
    rotated = tl.reshape(tl.join(x1 * c - x2 * sn, x2 * c + x1 * sn), (BLOCK_N,)).to(ty)
    out = tl.where(head < n_q_heads + n_kv_heads, rotated, out)
    tl.store(y_ptr + r * stride_ym + n, out, mask=ok)
    slot = tl.load(slot_ptr + r, mask=r < M, other=-1).to(tl.int64)
    kv = head - n_q_heads  # k heads 0 .. Hkv - 1, then v heads
    which = kv // n_kv_heads
    dst = (cache_ptr + which * stride_c2 + (slot // page) * stride_cb + (slot % page) * stride_ct
           + (kv % n_kv_heads) * stride_ch + (n - head * 2 * HALF))
    tl.store(dst, out.to(cache_ptr.dtype.element_ty), mask=ok & (kv >= 0) & (slot >= 0))


@triton.jit
def _gemv_body(x_ptr, res_ptr, g_ptr, sum_ptr, w_ptr, s_ptr, y_ptr, M, N, K, block_n, eps,
               stride_xm, stride_wn, stride_sn, stride_sk, stride_ym, stride_ys,
               ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_: tl.constexpr,
               SPLIT_K: tl.constexpr, ROW_SCALE: tl.constexpr, NUM_STAGES: tl.constexpr, GATED: tl.constexpr,
               NORM: tl.constexpr, HAS_RES: tl.constexpr, hg_ptr, part_ptr, n_parts,
               RESIDUAL_OUT: tl.constexpr, PRENORMED: tl.constexpr, PART_BLOCK: tl.constexpr,
               pos_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, stride_cos, stride_c2, stride_cb, stride_ct,
               stride_ch, n_q_heads, n_kv_heads, page, ROPE_KV: tl.constexpr, HALF: tl.constexpr):
    """Every FP8 GEMV kernel's program. NORM: the input is RMSNorm(x + residual) * g, each program
    summing the squares of whole rows as it streams them (no split-K) and scaling its finished sums
    by 1 / rms once; program 0 writes the summed residual. RESIDUAL_OUT (no split-K): instead of
    y, the epilogue writes h = y + residual (sum_ptr), h * g (hg_ptr) and the per-program sums of
    h's squares (part_ptr [programs, PART_ROWS]; _residual_row). PRENORMED: x is such an h * g and
    the finished sums are scaled by 1 / rms from the producer's n_parts partial sums (_inv_rms).
    ROPE_KV (rows <= 2, no split-K): W is a fused q | k | v projection of heads of 2 * HALF rows;
    a program takes BLOCK_N // 2 channel pairs of one head, interleaved, and its epilogue rotates
    q and k and writes k and v to the paged cache (_rope_kv_row)."""
    G: tl.constexpr = BLOCK_K // GROUP_
    first = tl.program_id(0) == 0
    head = 0
    p0 = 0
    if ROPE_KV:  # rows (head, p0 + i // 2 + (i % 2) * HALF): a pair's two channels side by side
        per_head: tl.constexpr = HALF // (BLOCK_N // 2)
        head = tl.program_id(0) // per_head
        p0 = (tl.program_id(0) % per_head) * (BLOCK_N // 2)
        i = tl.arange(0, BLOCK_N)
        n = head * 2 * HALF + (i % 2) * HALF + p0 + i // 2
    else:
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    g = tl.arange(0, G)
    col = g[:, None] * GROUP_ + tl.arange(0, GROUP_)[None, :]  # [G, 128]: a tile's columns from k0
    # tiles are [G, BLOCK_N, 128]: w[g, i, c] is weight row n[i], column k0 + g * 128 + c
    w_rows = w_ptr + n[None, :, None].to(tl.int64) * stride_wn
    s_rows = s_ptr + (n // block_n)[None, :] * stride_sn
    k_lo, k_hi, y_base = split_k_range(y_ptr, K, stride_ys, GROUP_, SPLIT_K)
    acc0 = tl.zeros((G, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((G, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((G, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((G, BLOCK_N), dtype=tl.float32)
    ss0 = tl.zeros((G, GROUP_), dtype=tl.float32)  # NORM: the rows' squares, per column of the tile
    ss1 = tl.zeros((G, GROUP_), dtype=tl.float32)
    ss2 = tl.zeros((G, GROUP_), dtype=tl.float32)
    ss3 = tl.zeros((G, GROUP_), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + col
        k_ok = kk < k_hi
        w = tl.load(w_rows + kk[:, None, :], mask=n_ok[None, :, None] & k_ok[:, None, :], other=0.0).to(tl.float32)
        s = tl.zeros((G, BLOCK_N), dtype=tl.float32)
        if not ROW_SCALE:  # masked to 0 past K: a padded group adds 0 * 0, never 0 * garbage
            s = tl.load(s_rows + ((k0 // GROUP_) + g)[:, None] * stride_sk,
                        mask=n_ok[None, :] & (k0 + g * GROUP_ < k_hi)[:, None], other=0.0)
        acc0, ss0 = _row_step(acc0, ss0, x_ptr, res_ptr, g_ptr, sum_ptr, 0, M, stride_xm, kk, k_ok, K, w, s, first,
                              ROW_SCALE, GATED, NORM, HAS_RES)
        if ROWS > 1:
            acc1, ss1 = _row_step(acc1, ss1, x_ptr, res_ptr, g_ptr, sum_ptr, 1, M, stride_xm, kk, k_ok, K, w, s,
                                  first, ROW_SCALE, GATED, NORM, HAS_RES)
        if ROWS > 2:
            acc2, ss2 = _row_step(acc2, ss2, x_ptr, res_ptr, g_ptr, sum_ptr, 2, M, stride_xm, kk, k_ok, K, w, s,
                                  first, ROW_SCALE, GATED, NORM, HAS_RES)
            acc3, ss3 = _row_step(acc3, ss3, x_ptr, res_ptr, g_ptr, sum_ptr, 3, M, stride_xm, kk, k_ok, K, w, s,
                                  first, ROW_SCALE, GATED, NORM, HAS_RES)
    rs = tl.full((BLOCK_N,), 1.0, tl.float32)
    if ROW_SCALE:
        rs = tl.load(s_ptr + (n // block_n) * stride_sn, mask=n_ok, other=0.0)
    if NORM:
        acc0 = acc0 * tl.rsqrt(tl.sum(tl.sum(ss0, 1), 0) / K + eps)
        acc1 = acc1 * tl.rsqrt(tl.sum(tl.sum(ss1, 1), 0) / K + eps)
        acc2 = acc2 * tl.rsqrt(tl.sum(tl.sum(ss2, 1), 0) / K + eps)
        acc3 = acc3 * tl.rsqrt(tl.sum(tl.sum(ss3, 1), 0) / K + eps)
    if PRENORMED:
        acc0 = acc0 * _inv_rms(part_ptr, n_parts, 0, K, eps, PART_BLOCK)
        if ROWS > 1:
            acc1 = acc1 * _inv_rms(part_ptr, n_parts, 1, K, eps, PART_BLOCK)
    if RESIDUAL_OUT:
        _residual_row(acc0, rs, 0, M, n, n_ok, res_ptr, g_ptr, sum_ptr, hg_ptr, part_ptr, stride_ym)
        if ROWS > 1:
            _residual_row(acc1, rs, 1, M, n, n_ok, res_ptr, g_ptr, sum_ptr, hg_ptr, part_ptr, stride_ym)
    elif ROPE_KV:
        _rope_kv_row(acc0, rs, 0, M, n, n_ok, y_ptr, stride_ym, head, p0, pos_ptr, cos_ptr, sin_ptr, cache_ptr,
                     slot_ptr, stride_cos, stride_c2, stride_cb, stride_ct, stride_ch, n_q_heads, n_kv_heads, page,
                     BLOCK_N, HALF)
        if ROWS > 1:
            _rope_kv_row(acc1, rs, 1, M, n, n_ok, y_ptr, stride_ym, head, p0, pos_ptr, cos_ptr, sin_ptr, cache_ptr,
                         slot_ptr, stride_cos, stride_c2, stride_cb, stride_ct, stride_ch, n_q_heads, n_kv_heads,
                         page, BLOCK_N, HALF)
    else:
        store_rows(y_base, n, n_ok, rs, M, stride_ym, acc0, acc1, acc2, acc3, ROWS)


# stride_ys (M * N, the split-K plane stride) unspecialized: its divisibility by 16 would differ
# between row counts at an N that is not a multiple of 16, building a variant warm-up never ran
@triton.jit(do_not_specialize=["stride_ys"])
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, block_n,
                     stride_xm, stride_wn, stride_sn, stride_sk, stride_ym, stride_ys,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_: tl.constexpr,
                     SPLIT_K: tl.constexpr, ROW_SCALE: tl.constexpr, NUM_STAGES: tl.constexpr,
                     GATED: tl.constexpr = False):
    _gemv_body(x_ptr, x_ptr, x_ptr, x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, block_n, 0.0,
               stride_xm, stride_wn, stride_sn, stride_sk, stride_ym, stride_ys,
               ROWS, BLOCK_N, BLOCK_K, GROUP_, SPLIT_K, ROW_SCALE, NUM_STAGES, GATED, False, False,
               x_ptr, s_ptr, 0, False, False, 1, x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, 0, 0, 0, 0, 0, 0, 1, 1, False, 1)


# The GEMV with the RMSNorm before it joined in: its own kernel (and name in profiles).
@triton.jit(do_not_specialize=["eps"])
def _fp8_norm_gemv_kernel(x_ptr, res_ptr, g_ptr, sum_ptr, w_ptr, s_ptr, y_ptr, M, N, K, block_n, eps,
                          stride_xm, stride_wn, stride_sn, stride_sk, stride_ym,
                          ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_: tl.constexpr,
                          ROW_SCALE: tl.constexpr, NUM_STAGES: tl.constexpr, HAS_RES: tl.constexpr):
    _gemv_body(x_ptr, res_ptr, g_ptr, sum_ptr, w_ptr, s_ptr, y_ptr, M, N, K, block_n, eps,
               stride_xm, stride_wn, stride_sn, stride_sk, stride_ym, 0,
               ROWS, BLOCK_N, BLOCK_K, GROUP_, 1, ROW_SCALE, NUM_STAGES, False, True, HAS_RES,
               x_ptr, s_ptr, 0, False, False, 1, x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, 0, 0, 0, 0, 0, 0, 1, 1, False, 1)


def pick_gemv_tile(n: int, k: int, sms: int, m: int = 1) -> tuple[int, int, int, int]:
    """(block_n_tile, block_k, split_k, num_warps) defaults for m rows, from bench_fp8_gemm on an
    H200 (llama-8b's qkv, o, gate_up and down; gemv_sweep_h200_2026-12-04_585c6a5.json): at one
    row 8 weight rows a program over 2 warps (the same 128 weights a thread as 16 rows over 4
    warps, twice the programs) led every shape (o 7.05 against 7.33 us, down 17.29 against 17.73);
    at two rows the same for N up to 4 x 8 rows a SM (o 8.17 against 8.73, down 19.38 against
    22.81), 16 rows over 4 warps and BLOCK_K 512 above (qkv 10.92 against 12.57); 8 warps lost
    everywhere. No split-K (a second launch that lost everywhere: qkv 9.36 us unsplit against
    11.90 split in 2, 14.84 in 4, at 58189b2). N below one program a SM takes 4 rows; BLOCK_K no
    wider than K needs."""
    narrow = m == 1 or (m == 2 and triton.cdiv(n, 8) <= 4 * sms)
    bn, warps = (8, 2) if narrow else (16, 4)
    if triton.cdiv(n, bn) < sms:
        bn = next((b for b in (8,) if triton.cdiv(n, b) >= sms), 4)
    bk = max(GROUP, min(1024 if narrow else 512, triton.next_power_of_2(k)))
    return bn, bk, 1, warps


def pick_norm_gemv_tile(n: int, k: int, sms: int, m: int = 1) -> tuple[int, int, int]:
    """(block_n_tile, block_k, num_warps) of the RMSNorm-joined GEMV: 16 rows over 4 warps (every
    program loads and squares the whole input rows, so fewer, taller programs), BLOCK_K 1024 at
    one row, 512 at more (58189b2's GEMV sweep)."""
    bn = next((b for b in (16, 8) if triton.cdiv(n, b) >= sms), 4)
    bk = max(GROUP, min(TILE_BYTES // 16 if m == 1 else TILE_BYTES // 32, triton.next_power_of_2(k)))
    return bn, bk, 4


def gemv_operands(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int, gated: bool,
                  what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMVs' argument check -> (x with a unit last stride, an empty [M, N] output in x's
    dtype). gated: x is gate | up [M, 2K] (unit last stride), checked as its first K columns."""
    if not gated:
        return w8a16_operands(x, w, w_scale, block_n, what)
    if x.dim() != 2 or x.shape[1] != 2 * w.shape[1] or x.stride(-1) != 1:
        raise ValueError(f"{what}: gated x must be [M, 2K] = [M, {2 * w.shape[1]}] with a unit last stride, "
                         f"got {tuple(x.shape)}")
    return x, w8a16_operands(x[:, : w.shape[1]], w, w_scale, block_n, what)[1]


def fp8_gemv_triton(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
                    block_n_tile: int | None = None, block_k: int | None = None, split_k: int | None = None,
                    num_warps: int | None = None, num_stages: int = 3, gated: bool = False) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS; bf16/fp16/fp32), w [N, K] E4M3 (unit last stride), w_scale
    [Sn, Sk] float32 -> y [M, N] in x's dtype, as reference.fp8_w8a16_gemm_reference.
    block_n: weight rows per scale row (128 block, 1 per-channel, N per-tensor, or a common divisor
    of fused parts). block_n_tile / block_k (a power-of-two multiple of 128) / split_k / num_warps /
    num_stages: the tile, defaults from pick_gemv_tile, 4 warps and 3 stages (two tiles loading
    while one is used; 16 KiB each at the default tiles, 38-67 KB of shared memory with x's rows
    in the sm_90 compile; benchmarks/bench_fp8_gemm.py sweeps them).
    split_k > 1 writes float32 partials to a [split_k, M, N] workspace (2 x split_k x M x N x 4
    bytes of traffic) summed by a second launch. gated: x is [M, 2K] (gate | up, unit last stride)
    and the product is SiLU(gate) * up @ W^T, the SiLU computed as the input is loaded (as
    ops.fused.silu_mul then this GEMV, one launch fewer)."""
    x, y = gemv_operands(x, w, w_scale, block_n, gated, "fp8_gemv")
    m, k = x.shape[0], w.shape[1]  # gated x holds 2K columns
    n = w.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"fp8_gemv: at most {MAX_ROWS} rows of x, got {m}")
    if m == 0 or n == 0:
        return y
    bn, bk, split, warps = pick_gemv_tile(n, k, num_sms(x.device), m)
    bn, bk, split = block_n_tile or bn, block_k or bk, split_k or split
    if bk % GROUP or bk & (bk - 1) or split < 1:
        raise ValueError(f"fp8_gemv: block_k a power-of-two multiple of {GROUP}, split_k >= 1; got {bk}, {split}")
    out = split_k_buffer(y, split)
    rows = triton.next_power_of_2(m)  # 3 rows take the 4-row variant, the 4th masked
    _fp8_gemv_kernel[(triton.cdiv(n, bn), split)](
        x, w, w_scale, out, m, n, k, block_n, x.stride(0), w.stride(0), w_scale.stride(0), _scale_k_stride(w_scale),
        out.stride(-2), out.stride(0) if split > 1 else 0, ROWS=rows, BLOCK_N=bn, BLOCK_K=bk, GROUP_=GROUP,
        SPLIT_K=split, ROW_SCALE=w_scale.shape[1] == 1, NUM_STAGES=num_stages, num_warps=num_warps or warps,
        GATED=gated)
    sum_split_k(out, y, split)
    return y


def fp8_norm_gemv_triton(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                         w: torch.Tensor, w_scale: torch.Tensor, block_n: int, block_n_tile: int | None = None,
                         block_k: int | None = None, num_warps: int | None = None,
                         num_stages: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm and the GEMV in one launch: x [M, K] (M <= MAX_ROWS; the block output), residual
    [M, K] or None, norm_weight [K] -> (y [M, N] in x's dtype, h) with h = x + residual (rounded to
    x's dtype, a new tensor; x itself without a residual) and y = (RMSNorm(h) * norm_weight) @ W^T,
    as ops.fused.add_rms_norm (or rms_norm) then fp8_gemv_triton, except that the normalized input
    is not rounded to x's dtype (the sums are scaled by 1 / rms once, in float32). The tile is
    pick_gemv_tile's; no split-K (each program needs whole rows for their rms)."""
    x, y = w8a16_operands(x, w, w_scale, block_n, "fp8_norm_gemv")
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"fp8_norm_gemv: at most {MAX_ROWS} rows of x, got {m}")
    if norm_weight.shape != (k,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"fp8_norm_gemv: norm_weight must be [K] = [{k}] and residual x's shape {tuple(x.shape)}, "
                         f"got {tuple(norm_weight.shape)} and {None if residual is None else tuple(residual.shape)}")
    x = x.contiguous()
    h = x if residual is None else torch.empty_like(x)
    if m == 0 or n == 0:
        if residual is not None:
            torch.add(x, residual, out=h)
        return y, h
    bn, bk, warps = pick_norm_gemv_tile(n, k, num_sms(x.device), m)
    bn, bk = block_n_tile or bn, block_k or bk
    if bk % GROUP or bk & (bk - 1):
        raise ValueError(f"fp8_norm_gemv: block_k a power-of-two multiple of {GROUP}, got {bk}")
    res = x if residual is None else residual.contiguous()
    _fp8_norm_gemv_kernel[(triton.cdiv(n, bn),)](
        x, res, norm_weight.contiguous(), h, w, w_scale, y, m, n, k, block_n, eps, x.stride(0), w.stride(0),
        w_scale.stride(0), _scale_k_stride(w_scale), y.stride(0), ROWS=triton.next_power_of_2(m), BLOCK_N=bn,
        BLOCK_K=bk, GROUP_=GROUP, ROW_SCALE=w_scale.shape[1] == 1, NUM_STAGES=num_stages,
        HAS_RES=residual is not None, num_warps=num_warps or warps)
    return y, h


__all__ = ["MAX_ROWS", "PART_BLOCK", "TILE_BYTES", "fp8_gemv_triton", "gemv_operands", "fp8_norm_gemv_triton", "pick_gemv_tile",
           "pick_norm_gemv_tile", "split_k_range",
           "store_rows"]
