"""Block-FP8 W8A8 GEMM for decode and verify steps (a few to a few hundred rows), computed
transposed: y^T [N, M] = W [N, K] @ xq^T [K, M], W E4M3 [N, K] with float32 scales [Sn, Sk]
(reference.py's layout), xq E4M3 [M, K] quantized per token and 128 columns with float32 scales
[M, ceil(K/128)] (triton_quant.py). Same contract as triton_gemm.fp8_w8a8_gemm_triton
(reference.fp8_w8a8_gemm_reference).

Why this kernel: at decode rows the weights are the step's whole cost, so a GEMM is fast when the
whole GPU streams them. The prefill GEMM (triton_gemm.py) and cuBLAS's block-scaled GEMM tile the
token rows by 64-128 and the weights by 128, which leaves most SMs idle for the 4,096-row
projections (32 programs on 132 SMs: cuBLAS read llama-8b's weights at 2.05 TB/s in a 128-row
step). Here the weight rows are the MMA's M side (64 or 128 a program), the tokens its N side
(16-128), and split-K gives the short-N projections enough programs. Both operands stay E4M3 (one
FP8 tensor-core dot per 128-deep step, no widening; float32 models widen them to fp16,
triton_gemm.e4m3_dot), scaled per weight row by the block scale and per token by the activation
scale before joining the float32 sum.

The grid is (N / BLOCK_N, split_k, M / BLOCK_T). With split_k > 1 each program takes a contiguous
range of whole 128-column groups of K (triton_gemv.split_k_range) and writes float32 partial sums
to its plane of a [split_k, M, N] workspace, which triton_gemm's _split_k_sum_kernel adds in a
fixed order (deterministic, no atomics, no host sync: CUDA-graph safe). The default launch is
pick_w8a8_swap_tile's."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.device import num_sms
from qsaserve.ops.fp8_gemm.reference import GROUP
from qsaserve.ops.fp8_gemm.triton_gemm import _check, _scale_k_stride, e4m3_dot, split_k_buffer, sum_split_k
from qsaserve.ops.fp8_gemm.triton_gemv import split_k_range
from qsaserve.ops.fp8_gemm.triton_swap_ab import swap_tile

MAX_BLOCK_T = 128  # token columns a program; more rows run as more token blocks (weights re-read from L2)


# M and stride_ys (M * N, the split-K plane stride) unspecialized: the rows change with every step,
# and the plane stride's divisibility by 16 would follow M at an N that is not a multiple of 16:
# one build for every row count of a token block size
@triton.jit(do_not_specialize=["M", "stride_ys"])
def _w8a8_swap_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, N, K, block_n,
                      stride_xm, stride_xsm, stride_wn, stride_wsn, stride_wsk, stride_ym, stride_ys,
                      BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                      EXACT: tl.constexpr):
    offs_n, offs_t, n_ok, t_ok, w_rows, x_cols = swap_tile(w_ptr, x_ptr, M, N, stride_wn, stride_xm, BLOCK_N, BLOCK_T)
    offs_k = tl.arange(0, BLOCK_K)
    ws_rows = ws_ptr + (offs_n // block_n) * stride_wsn
    xs_cols = xs_ptr + offs_t.to(tl.int64) * stride_xsm
    k_lo, k_hi, y_base = split_k_range(y_ptr, K, stride_ys, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        xt = tl.load(x_cols + kk[:, None], mask=k_ok[:, None] & t_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_T]
        g = k0 // BLOCK_K
        w_s = tl.load(ws_rows + g * stride_wsk, mask=n_ok, other=0.0)
        x_s = tl.load(xs_cols + g, mask=t_ok, other=0.0)
        acc += e4m3_dot(w, xt, EXACT) * w_s[:, None] * x_s[None, :]
    y_ptrs = y_base + offs_t[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & t_ok[None, :])


def swap_block_t(m: int) -> int:
    """Token columns a program: tl.dot's 16 at least, MAX_BLOCK_T at most."""
    return max(16, min(MAX_BLOCK_T, triton.next_power_of_2(m)))


def pick_w8a8_swap_tile(m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int]:
    """(block_n_tile, split_k, num_warps, num_stages) for m rows by an [n, k] weight, from
    benchmarks/bench_fp8_swap.py on an H200 (fp8_swap_h200_2026-12-03_69ea61a.json, llama-8b's
    four projections at 8-256 rows, 16 launches each): 64 weight rows a program and 4 warps; at 64
    token columns a weight of at least 128 rows a SM takes 128 rows a program and 4 stages (gate_up
    38.8 against 53.2 us: every program re-reads the activation tile from L2); the fewest K splits
    in 1, 2, 4 that give 1.5 programs an SM without cutting K below 4 blocks of 128 a program
    (gate_up's 224 programs at 64 tokens lost 30% split in 2); 5 stages for split programs up to 32
    token columns (their K ranges are short: down at 8 rows 20.4 against 23.1 us at 3), else 3
    (gate_up unsplit at 32 rows: 34.5 against 46.3 us at 5; at 64 tokens 5 lost 6-40%). Within 3%
    of the sweep's best at every llama-8b shape from 8 to 64 rows."""
    block_t = swap_block_t(m)
    wide = block_t == 64 and triton.cdiv(n, 128) >= sms
    bn = 128 if wide else 64
    programs = triton.cdiv(n, bn) * triton.cdiv(m, block_t)
    split = 1
    while split < 4 and 2 * programs * split < 3 * sms and triton.cdiv(k, GROUP) >= 8 * split:
        split *= 2
    stages = 4 if wide else (5 if split > 1 and block_t <= 32 else 3)
    return bn, split, 4, stages


def fp8_w8a8_swap_triton(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         block_n: int, out_dtype: torch.dtype, block_n_tile: int | None = None,
                         split_k: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None) -> torch.Tensor:
    """xq [M, K] E4M3, x_scale [M, ceil(K/128)] float32, w [N, K] E4M3, w_scale [Sn, Sk] ->
    [M, N] in out_dtype, as reference.fp8_w8a8_gemm_reference (x_scale with a unit column
    stride). block_n_tile (weight rows a program, a power of two >= 16), split_k, num_warps,
    num_stages: the launch, None from
    pick_w8a8_swap_tile (benchmarks/bench_fp8_swap.py sweeps them)."""
    _check(xq, w, w_scale, block_n, "fp8_w8a8_swap")
    m, k = xq.shape
    n = w.shape[0]
    if (x_scale.dim() != 2 or x_scale.shape[0] < m or x_scale.shape[1] != triton.cdiv(k, GROUP)
            or x_scale.stride(1) != 1):
        raise ValueError(f"fp8_w8a8_swap: x_scale must be [M, ceil(K/{GROUP})] = [{m}, {triton.cdiv(k, GROUP)}] with a "
                         f"unit column stride, got {tuple(x_scale.shape)} with strides {x_scale.stride()}")
    launch = (block_n_tile, split_k, num_warps, num_stages)
    if None in launch:
        rule = pick_w8a8_swap_tile(m, n, k, num_sms(xq.device))
        launch = tuple(rule[i] if v is None else v for i, v in enumerate(launch))
    bn, split, warps, stages = launch
    if split < 1 or bn < 16 or bn & (bn - 1):
        raise ValueError(f"fp8_w8a8_swap: split_k >= 1 and block_n_tile a power of two >= 16, got {split}, {bn}")
    if xq.stride(-1) != 1:
        xq = xq.contiguous()
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return y
    block_t = swap_block_t(m)
    out = split_k_buffer(y, split)
    grid = (triton.cdiv(n, bn), split, triton.cdiv(m, block_t))
    _w8a8_swap_kernel[grid](xq, x_scale, w, w_scale, out, m, n, k, block_n, xq.stride(0), x_scale.stride(0),
                            w.stride(0), w_scale.stride(0), _scale_k_stride(w_scale), out.stride(-2),
                            out.stride(0) if split > 1 else 0, BLOCK_N=bn, BLOCK_T=block_t, BLOCK_K=GROUP,
                            SPLIT_K=split, EXACT=out_dtype == torch.float32, num_warps=warps,
                            num_stages=stages)
    sum_split_k(out, y, split)
    return y


__all__ = ["MAX_BLOCK_T", "fp8_w8a8_swap_triton", "pick_w8a8_swap_tile", "swap_block_t"]
