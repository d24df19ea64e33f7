"""FP8-weight W8A16 GEMM for decode batches (a few to 64 rows; the engine's path there under
QSASERVE_FP8_DECODE_KERNEL=swap, the W8A8 transposed GEMM otherwise), computed transposed:
y^T [N, M] = W [N, K] @ x^T [K, M], W E4M3 [N, K] with float32 scales [Sn, Sk] (reference.py's
layout), x bf16/fp16/fp32 [M, K] not quantized. Same contract as triton_gemm.fp8_w8a16_gemm_triton
(reference.fp8_w8a16_gemm_reference).

Why transposed ("swap AB"): in x @ W^T the widened weight tile is tl.dot's B operand, which a
Hopper tensor-core MMA (wgmma) reads from shared memory only, so every K step stores the E4M3
tile widened to bf16 back to shared memory before the MMA; and the MMA's M side is the token
rows, padded to 64. Transposed, the weight tile is the A operand, which wgmma may take from
registers: loaded (pipelined through shared memory as E4M3, 1 byte a weight), widened in
registers, fed to the MMA, while x^T, the B operand, streams through shared memory untouched. The
tokens become the MMA's N side (16 to 64 here). Each 128-deep K step is one dot, scaled by the
weights' block scale per row before it joins the float32 sum (E4M3 is exact in bf16).

The grid is (N / BLOCK_N, split_k, M / BLOCK_T). With split_k > 1 each program takes a contiguous
range of whole 128-column groups of K (triton_gemv.split_k_range) and writes its float32 partial
sums to its plane of a [split_k, M, N] workspace, which triton_gemm's _split_k_sum_kernel adds in
a fixed order (deterministic, no atomics, no host sync: CUDA-graph safe).

The launch (64 weight rows, 4 warps, 4 stages, pick_swap_split_k's splits) is the one that led
benchmarks/bench_fp8_gemm.py's sweep on an H200 at llama-8b's shapes and 8-64 rows
(docs/weight_quantization.md): 128 weight rows a program lost at every shape."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.device import num_sms
from qsaserve.ops.fp8_gemm.reference import GROUP
from qsaserve.ops.fp8_gemm.triton_gemm import (_scale_k_stride, decode_block_m, split_k_buffer, sum_split_k,
                                              w8a16_operands)
from qsaserve.ops.fp8_gemm.triton_gemv import split_k_range


SWAP_BLOCK_N = 64  # weight rows a program: one warpgroup's MMA M
SWAP_WARPS = 4
SWAP_STAGES = 4


def pick_swap_split_k(n: int, k: int, sms: int, block_n_tile: int = SWAP_BLOCK_N) -> int:
    """The fewest K splits in 1, 2, 4 that give at least 2 programs an SM, without cutting K below
    4 blocks of 128 a program. On an H200 (132 SMs) at llama-8b's shapes: gate_up (448 row blocks)
    1, qkv (96), o and down (64) 4, each the sweep's best or within 10% of it at 8-64 rows."""
    programs = triton.cdiv(n, block_n_tile)
    split = 1
    while split < 4 and programs * split < 2 * sms and triton.cdiv(k, GROUP) >= 8 * split:
        split *= 2
    return split


@triton.jit
def swap_tile(w_ptr, x_ptr, M, N, stride_wn, stride_xm, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr):
    """The transposed FP8 kernels' tile (W8A16 here, W8A8 in triton_w8a8_swap.py): program (pid_n, ., pid_t)
    takes weight rows offs_n and token columns offs_t -> (offs_n, offs_t, n_ok, t_ok, the weight
    rows' base pointers [BLOCK_N, 1], x^T's column pointers [1, BLOCK_T])."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    x_cols = x_ptr + offs_t[None, :].to(tl.int64) * stride_xm
    return offs_n, offs_t, offs_n < N, offs_t < M, w_rows, x_cols


@triton.jit
def _w8a16_swap_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, block_n,
                       stride_xm, stride_wn, stride_sn, stride_sk, stride_ym, stride_ys,
                       BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, PRECISION: tl.constexpr):
    offs_n, offs_t, n_ok, t_ok, w_rows, x_cols = swap_tile(w_ptr, x_ptr, M, N, stride_wn, stride_xm, BLOCK_N, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    s_rows = s_ptr + (offs_n // block_n) * stride_sn
    k_lo, k_hi, y_base = split_k_range(y_ptr, K, stride_ys, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K] E4M3
        xt = tl.load(x_cols + kk[:, None], mask=k_ok[:, None] & t_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_T]
        s = tl.load(s_rows + (k0 // BLOCK_K) * stride_sk, mask=n_ok, other=0.0)
        acc += tl.dot(w.to(xt.dtype), xt, input_precision=PRECISION) * s[:, None]
    y_ptrs = y_base + offs_t[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & t_ok[None, :])


def fp8_w8a16_swap_triton(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
                          block_n_tile: int = SWAP_BLOCK_N, split_k: int | None = None,
                          num_warps: int = SWAP_WARPS, num_stages: int = SWAP_STAGES) -> torch.Tensor:
    """x [M, K] bf16/fp16/fp32, w [N, K] E4M3, w_scale [Sn, Sk] -> [M, N] in x's dtype, as
    reference.fp8_w8a16_gemm_reference. block_n_tile: weight rows a program (the MMA's M: 64 a
    warpgroup); split_k: programs a row block over K (None: pick_swap_split_k); num_warps / num_stages: the launch
    (benchmarks/bench_fp8_gemm.py sweeps them). M above 64 runs as more token blocks, each
    re-reading the weights."""
    x, y = w8a16_operands(x, w, w_scale, block_n, "fp8_w8a16_swap")
    if split_k is None:
        split_k = pick_swap_split_k(w.shape[0], w.shape[1], num_sms(x.device), block_n_tile)
    if split_k < 1 or block_n_tile < 16:
        raise ValueError(f"fp8_w8a16_swap: split_k must be >= 1 and block_n_tile >= 16, got {split_k}, {block_n_tile}")
    m, k = x.shape
    n = w.shape[0]
    if m == 0 or n == 0:
        return y
    block_t = decode_block_m(m)  # token columns a program: tl.dot's 16 at least, at most 64
    out = split_k_buffer(y, split_k)
    grid = (triton.cdiv(n, block_n_tile), split_k, triton.cdiv(m, block_t))
    _w8a16_swap_kernel[grid](x, w, w_scale, out, m, n, k, block_n, x.stride(0), w.stride(0), w_scale.stride(0),
                             _scale_k_stride(w_scale), out.stride(-2), out.stride(0) if split_k > 1 else 0,
                             BLOCK_N=block_n_tile, BLOCK_T=block_t, BLOCK_K=GROUP, SPLIT_K=split_k,
                             PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                             num_warps=num_warps, num_stages=num_stages)
    sum_split_k(out, y, split_k)
    return y


__all__ = ["SWAP_BLOCK_N", "fp8_w8a16_swap_triton", "pick_swap_split_k", "swap_tile"]
