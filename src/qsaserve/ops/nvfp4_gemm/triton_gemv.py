"""NVFP4-weight GEMV for decode at 1-4 rows (reference.py's ModelOpt layout): y [M, N] = x [M, K] @
W^T with W[n, k] = e2m1(code[n, k]) * scale[n, k // 16] * row_scale[n]. No tl.dot (which pads M
to 16 rows): each program streams BLOCK_N weight rows of packed E2M1 bytes (0.5625 bytes a weight
with the group scales), decodes them in registers and multiplies them by every row of x (FMA),
float32 sums, the weights read once for all rows.

A tile is [BLOCK_K / 16, BLOCK_N, 2] int32 words (the packed bytes read 4 at a time: 8 codes a
word, code j in bits 4j..4j+3 is column 8 * word + j, as the reference's low-nibble-first bytes
give), groups first as in ops/fp8_gemm/triton_gemv.py so each thread covers several weight rows of
the same columns. Each 16-column group is summed, then scaled by its E4M3 group scale; the row
scale once at the end.

E2M1 decode by bit arithmetic, no lookup or exp2: code j shifted to bits 28-31, an arithmetic
shift right by 6 and a mask leave its sign at float32 bit 31 and its 3 magnitude bits at bits
22-24 (the exponent's low two bits and the first mantissa bit), which read as e2m1 * 2^-126
exactly (code 1, 0.5, as a subnormal): 3 integer ops a weight (sm_90 SASS of the 16 x 512 loop at
one row: 386 instructions an iteration, 64 weights a thread, against 430 loading and decoding
byte by byte). x is multiplied by 2^64 first (its
products stay normal floats) and the sums by 2^62 at the end. That needs denormals kept, which
Triton's default float32 arithmetic does (no .ftz in its PTX). Not yet timed on a GPU.

Split over K (split_k > 1): contiguous ranges of whole 16-column groups per program, float32
partials in a [split_k, M, N] workspace added in a fixed order by a second launch (the FP8
GEMMs' _split_k_sum_kernel; deterministic, no atomics, CUDA-graph safe)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.device import num_sms
from qsaserve.ops.fp8_gemm.triton_gemm import split_k_buffer, sum_split_k
from qsaserve.ops.fp8_gemm.triton_gemv import split_k_range, store_rows
from qsaserve.ops.nvfp4_gemm.reference import GROUP

MAX_ROWS = 4  # rows of x one pass over the weights serves
TILE_BYTES = 4096  # default packed bytes a program loads an iteration: 8192 weights, as the FP8 GEMV's tile
# x's factor, undone with 2^-64 * 2^126 = 2^62 on the sums: products of x and a decoded weight
# (e2m1 * 2^-126) stay normal floats for |x| >= 2^-64, and x * 2^64 is finite for |x| < 2^64
X_PRESCALE = tl.constexpr(2.0**64)
SUM_FACTOR = tl.constexpr(2.0**62)
_SIGN_MAG = tl.constexpr(-2118123520)  # 0x81C00000 as int32: bit 31 and bits 22-24


@triton.jit
def _e2m1_scaled(top):
    """int32 with an E2M1 code in bits 28-31 (sign at 31) -> float32 e2m1(code) * 2^-126, exact
    (code 1, 0.5, a subnormal): the arithmetic shift puts the magnitude at bits 22-24 (the float's
    low exponent bits and first mantissa bit) and copies the sign down, the mask keeps both.
    Three integer ops a weight."""
    return ((top >> 6) & _SIGN_MAG).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_bits(codes):
    """uint8 E2M1 codes (low 4 bits) -> float32 e2m1(code) * 2^-126, exact (code 1 a subnormal):
    the magnitude bits at float32 bits 22-24, the sign at bit 31 (_e2m1_scaled's result, one
    code a byte)."""
    c = codes.to(tl.int32)
    return (((c & 7) << 22) | ((c & 8) << 28)).to(tl.float32, bitcast=True)


_TWO_63 = tl.constexpr(2.0**63)
_TWO_126 = tl.constexpr(2.0**126)


@triton.jit
def scaled_e2m1(w, s, UNSCALED: tl.constexpr):
    """The tensor-core kernels' weights: w [N, G, 16] = e2m1 * 2^-126 (e2m1_bits,
    _decode_words) times their group scales s [N, G] (float32), as e2m1 * s * 2^-63: exact (at
    most 6 significant bits) and a normal float in bf16 / fp32, whose sums then take
    sums_factor(). UNSCALED (fp16 activations: 5 exponent bits): e2m1 * s itself."""
    if UNSCALED:
        return (w * _TWO_126) * s[:, :, None]
    return w * (s * _TWO_63)[:, :, None]


@triton.jit
def sums_factor(UNSCALED: tl.constexpr):
    """What sums of scaled_e2m1 weights are multiplied by (with the rows' global scales)."""
    if UNSCALED:
        return 1.0
    return _TWO_63


@triton.jit
def _decode_words(words, G: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_: tl.constexpr):
    """int32 words [G, BLOCK_N, 2] (8 codes each) -> float32 [G, BLOCK_N, 16] e2m1 * 2^-126 in
    column order: code j of word i is column 8i + j. Shifting code j to bits 28-31 drops the codes
    above it and leaves those below under the mask."""
    v0 = _e2m1_scaled(words << 28)
    v1 = _e2m1_scaled(words << 24)
    v2 = _e2m1_scaled(words << 20)
    v3 = _e2m1_scaled(words << 16)
    v4 = _e2m1_scaled(words << 12)
    v5 = _e2m1_scaled(words << 8)
    v6 = _e2m1_scaled(words << 4)
    v7 = _e2m1_scaled(words)
    # join appends a last dim of 2: three levels give [.., 2 (word), 2, 2, 2] indexed by j's bits
    # 2, 1, 0 (bit 0 joined last), so the reshape's column is 8 * word + j
    even = tl.join(tl.join(v0, v4), tl.join(v2, v6))
    odd = tl.join(tl.join(v1, v5), tl.join(v3, v7))
    return tl.reshape(tl.join(even, odd), (G, BLOCK_N, GROUP_))


@triton.jit
def _row_partial(acc, x_ptr, r, M, stride_xm, kk, k_ok, w, s):
    """acc [G, BLOCK_N] += row r of x times the decoded tile w [G, BLOCK_N, 16], summed per
    16-column group and scaled by the group scales s [G, BLOCK_N]. Row r >= M adds 0."""
    xr = tl.load(x_ptr + r * stride_xm + kk, mask=k_ok & (r < M), other=0.0).to(tl.float32) * X_PRESCALE
    return acc + tl.sum(w * xr[:, None, :], 2) * s


# stride_ys (M * N, the split-K plane stride) unspecialized: its divisibility by 16 would differ
# between row counts at an N that is not a multiple of 16, building a variant warm-up never ran
@triton.jit(do_not_specialize=["stride_ys"])
def _nvfp4_gemv_kernel(x_ptr, w_ptr, s_ptr, r_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                       stride_ys, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_: tl.constexpr, SPLIT_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    G: tl.constexpr = BLOCK_K // GROUP_
    WORDS: tl.constexpr = GROUP_ // 8  # int32 words a group: 8 codes each, code j in bits 4j-4j+3
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    g = tl.arange(0, G)
    word = g[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # [G, 2]: a tile's words from k0 / 8
    col = g[:, None] * GROUP_ + tl.arange(0, GROUP_)[None, :]  # [G, 16]: its columns from k0
    w_rows = w_ptr + n[None, :, None].to(tl.int64) * stride_wn
    s_rows = s_ptr + n[None, :].to(tl.int64) * stride_sn
    k_lo, k_hi, y_base = split_k_range(y_ptr, K, stride_ys, GROUP_, SPLIT_K)  # K: whole 16-column groups
    acc0 = tl.zeros((G, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((G, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((G, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((G, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        wd = k0 // 8 + word
        # compared in words (k_hi / 8 a multiple of 2), so the mask is constant over a group's two
        # words and the load vectorizes (and pipelines: cp.async needs >= 4 bytes)
        words = tl.load(w_rows + wd[:, None, :], mask=n_ok[None, :, None] & (wd < k_hi // 8)[:, None, :], other=0)
        w = _decode_words(words, G, BLOCK_N, GROUP_)
        s = tl.load(s_rows + (k0 // GROUP_ + g)[:, None], mask=n_ok[None, :] & (k0 + g * GROUP_ < k_hi)[:, None],
                    other=0.0).to(tl.float32)
        kk = k0 + col
        k_ok = kk < k_hi
        acc0 = _row_partial(acc0, x_ptr, 0, M, stride_xm, kk, k_ok, w, s)
        if ROWS > 1:
            acc1 = _row_partial(acc1, x_ptr, 1, M, stride_xm, kk, k_ok, w, s)
        if ROWS > 2:
            acc2 = _row_partial(acc2, x_ptr, 2, M, stride_xm, kk, k_ok, w, s)
            acc3 = _row_partial(acc3, x_ptr, 3, M, stride_xm, kk, k_ok, w, s)
    rs = tl.load(r_ptr + n, mask=n_ok, other=0.0) * SUM_FACTOR
    store_rows(y_base, n, n_ok, rs, M, stride_ym, acc0, acc1, acc2, acc3, ROWS)


def w4a16_operands(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor, what: str,
                   max_rows: int | None = None):
    """The NVFP4 kernels' argument check (x [M, K], K a multiple of 16, packed [N, K/2], scale
    [N, K/16] with unit last strides, row_scale [N]; at most max_rows rows) -> (x with a unit
    last stride, packed as int32 words, row_scale contiguous, the output y [M, N] in x's dtype)."""
    m, k = x.shape
    n = packed.shape[0]
    if (k % GROUP or packed.shape[1] * 2 != k or packed.stride(-1) != 1 or tuple(scale.shape) != (n, k // GROUP)
            or scale.stride(-1) != 1 or row_scale.shape != (n,) or (max_rows is not None and m > max_rows)):
        rows = "M" if max_rows is None else f"M <= {max_rows}"
        raise ValueError(f"{what}: x [{rows}, K], packed [N, K/2], scale [N, K/16] (unit last strides), row_scale "
                         f"[N]; got {tuple(x.shape)}, {tuple(packed.shape)}, {tuple(scale.shape)}, "
                         f"{tuple(row_scale.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, packed_words(packed), row_scale.contiguous(), torch.empty((m, n), dtype=x.dtype, device=x.device)


def packed_words(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, K/2] as int32 [N, K/8] (the kernels read 4 bytes, 8 codes, a load
    element), a view where the row stride and offset allow, else a contiguous copy's."""
    try:
        return packed.view(torch.int32)
    except RuntimeError:  # a row stride or offset not a multiple of 4 bytes
        return packed.contiguous().view(torch.int32)


def pick_gemv_tile(n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(block_n_tile, block_k, split_k) defaults, NOT yet measured (bench_fp8_gemm sweeps them):
    BLOCK_N the widest of 16, 8, 4 rows giving >= 2 programs per SM; BLOCK_K 2 * TILE_BYTES /
    BLOCK_N columns, 64-4096 and no wider than K needs; split_k the fewest of 1, 2, 4, 8 reaching 4
    programs per SM while each program keeps >= 2 iterations. llama-8b on 132 SMs: qkv 16 x 512
    split 2, o 8 x 1024 split 2, gate_up 16 x 512 split 1, down 8 x 1024 split 2."""
    bn = next((b for b in (16, 8) if triton.cdiv(n, b) >= 2 * sms), 4)
    bk = max(4 * GROUP, min(2 * TILE_BYTES // bn, 4096, triton.next_power_of_2(k)))
    programs, groups = triton.cdiv(n, bn), k // GROUP
    split = 1
    while split < 8 and programs * split < 4 * sms and groups // (2 * split) >= 2 * (bk // GROUP):
        split *= 2
    return bn, bk, split


def nvfp4_gemv_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor,
                      block_n_tile: int | None = None, block_k: int | None = None, split_k: int | None = None,
                      num_warps: int | None = None, num_stages: int = 3) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS, K a multiple of 16; bf16/fp16/fp32), packed uint8 [N, K/2], scale
    E4M3 [N, K/16], row_scale float32 [N] -> [M, N] in x's dtype, as
    reference.nvfp4_w4a16_gemm_reference. block_n_tile / block_k (a power-of-two multiple of 64) /
    split_k / num_warps / num_stages: the tile (defaults pick_gemv_tile, 4 warps, 3 stages)."""
    x, words, row_scale, y = w4a16_operands(x, packed, scale, row_scale, "nvfp4_gemv", MAX_ROWS)
    m, k = x.shape
    n = packed.shape[0]
    if m == 0 or n == 0:
        return y
    bn, bk, split = pick_gemv_tile(n, k, num_sms(x.device))
    bn, bk, split = block_n_tile or bn, block_k or bk, split_k or split
    if bk % (4 * GROUP) or bk & (bk - 1) or split < 1:
        raise ValueError(f"nvfp4_gemv: block_k a power-of-two multiple of {4 * GROUP}, split_k >= 1; got {bk}, {split}")
    out = split_k_buffer(y, split)
    _nvfp4_gemv_kernel[(triton.cdiv(n, bn), split)](
        x, words, scale, row_scale, out, m, n, k, x.stride(0), words.stride(0), scale.stride(0), out.stride(-2),
        out.stride(0) if split > 1 else 0, ROWS=triton.next_power_of_2(m), BLOCK_N=bn, BLOCK_K=bk, GROUP_=GROUP,
        SPLIT_K=split, NUM_STAGES=num_stages, num_warps=num_warps or 4)
    sum_split_k(out, y, split)
    return y


__all__ = ["MAX_ROWS", "TILE_BYTES", "nvfp4_gemv_triton", "packed_words", "pick_gemv_tile"]
