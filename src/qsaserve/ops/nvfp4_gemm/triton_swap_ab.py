"""NVFP4-weight W4A16 GEMM computed transposed (ModelOpt's layout, reference.py):
y^T [N, M] = W [N, K] @ x^T [K, M], W[n, k] = e2m1(code[n, k]) * scale[n, k // 16] * row_scale[n],
x bf16/fp16/fp32 not quantized. Same contract as triton_gemm.nvfp4_w4a16_gemm_triton.

As ops/fp8_gemm/triton_swap_ab.py: the decoded weight tile is the tensor-core MMA's A operand,
which wgmma takes from registers (sm_90 TTGIR: warp_group_dot with A in registers; one layout
change of the decoded tile remains), where triton_gemm.py's B operand is stored to shared memory
every 128 columns, and the tokens are the MMA's N side (16-64 columns a program; more rows run as
more token blocks). The packed codes are read 4 bytes (8 codes) a load, decoded
by triton_gemv's bit arithmetic (3 integer ops a weight, e2m1 * 2^-126 exactly, code 1 a float32
subnormal) and multiplied once by their E4M3 group scale times 2^63, which leaves
e2m1 * scale * 2^-63: exact (at most 6 significant bits), a normal float32 and bfloat16, so the
widening to x's dtype is exact too; the float32 sums are multiplied by row_scale * 2^63 at the end.
For fp16 x (5 exponent bits) the decoded codes are first multiplied by 2^126 and then by the
scale, unscaled.

Grid (N / BLOCK_N, split_k, M / BLOCK_T); split_k > 1 takes contiguous ranges of whole 128-column
blocks of K (triton_gemv.split_k_range) into a float32 [split_k, M, N] workspace, added in a
fixed order (fp8_gemm's _split_k_sum_kernel): deterministic, no host sync. The launch defaults
(64 weight rows, 4 warps, 4 stages, fp8's pick_swap_split_k) led benchmarks/bench_fp8_gemm.py's
sweep on an H200; ops/nvfp4_gemm/__init__.py says which weights take it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.fp8_gemm.triton_gemm import decode_block_m, split_k_buffer, sum_split_k
from qsaserve.ops.device import num_sms
from qsaserve.ops.fp8_gemm.triton_gemv import split_k_range
from qsaserve.ops.fp8_gemm.triton_swap_ab import SWAP_BLOCK_N, SWAP_STAGES, SWAP_WARPS, pick_swap_split_k
from qsaserve.ops.nvfp4_gemm.reference import GROUP
from qsaserve.ops.nvfp4_gemm.triton_gemv import _decode_words, scaled_e2m1, sums_factor, w4a16_operands

BLOCK_K = 128  # columns a K step: 8 groups of 16, 64 packed bytes a weight row


@triton.jit
def _w4a16_swap_kernel(x_ptr, w_ptr, s_ptr, r_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                       stride_ys, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K_: tl.constexpr,
                       GROUP_: tl.constexpr, SPLIT_K: tl.constexpr, UNSCALED: tl.constexpr,
                       PRECISION: tl.constexpr):
    G: tl.constexpr = BLOCK_K_ // GROUP_
    WORDS: tl.constexpr = GROUP_ // 8  # int32 words a group
    pid_n, pid_t = tl.program_id(0), tl.program_id(2)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    n_ok, t_ok = n < N, t < M
    g = tl.arange(0, G)
    word = g[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # [G, 2]: a step's words from k0 / 8
    offs_k = tl.arange(0, BLOCK_K_)
    w_rows = w_ptr + n[:, None, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1, 1]
    s_rows = s_ptr + n[:, None].to(tl.int64) * stride_sn
    x_cols = x_ptr + t[None, :].to(tl.int64) * stride_xm  # [1, BLOCK_T]: x^T's columns
    k_lo, k_hi, y_base = split_k_range(y_ptr, K, stride_ys, BLOCK_K_, SPLIT_K)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K_):
        wd = k0 // 8 + word
        words = tl.load(w_rows + wd[None, :, :], mask=n_ok[:, None, None] & (wd < K // 8)[None, :, :], other=0)
        w = _decode_words(words, BLOCK_N, G, GROUP_)  # [BLOCK_N, G, 16]: e2m1 * 2^-126
        s = tl.load(s_rows + (k0 // GROUP_ + g)[None, :], mask=n_ok[:, None] & (k0 + g * GROUP_ < K)[None, :],
                    other=0.0).to(tl.float32)
        w = scaled_e2m1(w, s, UNSCALED)
        kk = k0 + offs_k
        xt = tl.load(x_cols + kk[:, None], mask=(kk < K)[:, None] & t_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_T]
        acc += tl.dot(tl.reshape(w, (BLOCK_N, BLOCK_K_)).to(xt.dtype), xt, input_precision=PRECISION)
    r = tl.load(r_ptr + n, mask=n_ok, other=0.0)
    r = r * sums_factor(UNSCALED)
    y_ptrs = y_base + t[None, :].to(tl.int64) * stride_ym + n[:, None]
    tl.store(y_ptrs, (acc * r[:, None]).to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & t_ok[None, :])


def nvfp4_w4a16_swap_triton(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, row_scale: torch.Tensor,
                            block_n_tile: int = SWAP_BLOCK_N, split_k: int | None = None,
                            num_warps: int = SWAP_WARPS, num_stages: int = SWAP_STAGES) -> torch.Tensor:
    """x [M, K] (K a multiple of 16), packed uint8 [N, K/2], scale E4M3 [N, K/16], row_scale float32
    [N] -> [M, N] in x's dtype, as reference.nvfp4_w4a16_gemm_reference. block_n_tile: weight rows
    a program (the MMA's M); split_k: programs a row block over K (None: pick_swap_split_k); num_warps / num_stages: the
    launch (benchmarks/bench_fp8_gemm.py sweeps them)."""
    x, words, row_scale, y = w4a16_operands(x, packed, scale, row_scale, "nvfp4_w4a16_swap")
    if split_k is None:
        split_k = pick_swap_split_k(packed.shape[0], x.shape[1], num_sms(x.device), block_n_tile)
    if split_k < 1 or block_n_tile < 16:
        raise ValueError(f"nvfp4_w4a16_swap: split_k must be >= 1 and block_n_tile >= 16, got {split_k}, {block_n_tile}")
    m, k = x.shape
    n = packed.shape[0]
    if m == 0 or n == 0:
        return y
    block_t = decode_block_m(m)  # token columns a program: tl.dot's 16 at least, at most 64
    out = split_k_buffer(y, split_k)
    grid = (triton.cdiv(n, block_n_tile), split_k, triton.cdiv(m, block_t))
    _w4a16_swap_kernel[grid](x, words, scale, row_scale, out, m, n, k, x.stride(0), words.stride(0), scale.stride(0),
                             out.stride(-2), out.stride(0) if split_k > 1 else 0, BLOCK_N=block_n_tile,
                             BLOCK_T=block_t, BLOCK_K_=BLOCK_K, GROUP_=GROUP, SPLIT_K=split_k,
                             UNSCALED=x.dtype == torch.float16,
                             PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                             num_warps=num_warps, num_stages=num_stages)
    sum_split_k(out, y, split_k)
    return y


__all__ = ["nvfp4_w4a16_swap_triton"]
