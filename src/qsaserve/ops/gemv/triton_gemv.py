"""y = x @ W^T for a few rows of x (decode at 1-4 rows) with unquantized weights (bf16 / fp16 /
float32): the FP8 GEMV's program (ops.fp8_gemm.triton_gemv._gemv_body) run over the weight's own
dtype with one unit scale, so a plain weight streams through the same tile layout, software
pipeline and split-K as an E4M3 one. Every weight byte is read once for all rows; the weight read
is the whole cost, so the grid is sized to keep every SM busy: narrow outputs (a hyper-connection's
320-wide down projection, its 4-wide inject, a router) split K over several programs whose float32
partials a second launch adds in a fixed order (deterministic, no atomics, CUDA-graph safe)."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from qsaserve.ops.device import num_sms
from qsaserve.ops.fp8_gemm.reference import GROUP
from qsaserve.ops.fp8_gemm.triton_gemm import split_k_buffer, sum_split_k
from qsaserve.ops.fp8_gemm.triton_gemv import _gemv_body

MAX_ROWS = 4  # rows of x one pass over the weights serves
MIN_SPLIT_COLS = 1024  # a split-K program's K range is at least this wide
_GROUP: tl.constexpr = tl.constexpr(GROUP)  # the body's column group, as a kernel reads a global


# stride_ys (the split-K plane stride) unspecialized: its divisibility by 16 would differ between
# row counts at an N that is not a multiple of 16, building a variant warm-up never ran
@triton.jit(do_not_specialize=["stride_ys"])
def _gemv_kernel(x_ptr, w_ptr, one_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_ys,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 NUM_STAGES: tl.constexpr, GATED: tl.constexpr = False):
    # one scale row (block_n = N) holding 1.0: the epilogue's multiply is exact
    _gemv_body(x_ptr, x_ptr, x_ptr, x_ptr, w_ptr, one_ptr, y_ptr, M, N, K, N, 0.0,
               stride_xm, stride_wn, 0, 0, stride_ym, stride_ys,
               ROWS, BLOCK_N, BLOCK_K, _GROUP, SPLIT_K, True, NUM_STAGES, GATED, False, False,
               x_ptr, one_ptr, 0, False, False, 1, x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, 0, 0, 0, 0, 0, 0, 1, 1, False, 1)


@functools.lru_cache(maxsize=None)  # a pure rule, asked at every eager call
def pick_gemv_tile(n: int, k: int, sms: int, elem_bytes: int = 2) -> tuple[int, int, int, int]:
    """(block_n, block_k, split_k, num_warps) defaults for bf16 weights (block_k scaled to keep
    the bytes for others), from benchmarks/bench_gemv.py on an H200 at 1 and 2 rows (one rule for both)
    (gemv_decode_h200_2026-12-04_3d5bcb1.json; cuBLAS in brackets): 8 weight rows over 2 warps,
    256 columns an iteration, for wide outputs over a short K (qwen4exp-small's GDN in_proj,
    12,352 x 2,048: 14.41 us [15.88]); 4 rows over 2 warps, 1,024 columns, for outputs up to 20
    rows a SM over a longer K (its GDN out_proj, 2,048 x 4,096: 6.49 [9.43]); 4 rows over 1 warp,
    512 columns, elsewhere (llama-8b's o 10.73 [13.06], gate_up 57.73 [60.65]). Programs take 8
    or 4 rows, the same weight bytes a thread as the FP8 GEMV's 8 rows over 2 warps. Below one
    program a SM, K is split (powers of two, ranges of at least MIN_SPLIT_COLS; a hyper-connection's
    320 x 8,192 down projection in 2: 5.46 [7.50])."""
    if 1024 <= k <= 2560 and triton.cdiv(n, 8) >= 4 * sms:
        bn, bk, warps = 8, 256, 2
    elif n <= 20 * sms and k >= 1024:
        bn, bk, warps = 4, 1024, 2
    else:
        bn, bk, warps = 4, 512, 1
    bk = max(GROUP, min(bk * 2 // elem_bytes, triton.next_power_of_2(k)))
    split = 1
    while triton.cdiv(n, bn) * split < sms and k // (2 * split) >= MIN_SPLIT_COLS:
        split *= 2
    return bn, bk, split, warps


_ONES: dict[torch.device, torch.Tensor] = {}


def _one(device: torch.device) -> torch.Tensor:
    """The unit scale, one per device, made by the first (eager) call: made inside a CUDA graph's
    capture, its memory and its fill would belong to the graph."""
    if device not in _ONES:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gemv: the first call on a device must run eagerly, not inside CUDA graph capture")
        _ONES[device] = torch.ones((1, 1), dtype=torch.float32, device=device)
    return _ONES[device]


def gemv(x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None, block_k: int | None = None,
         split_k: int | None = None, num_warps: int | None = None, num_stages: int = 3,
         gated: bool = False, sum_split: bool = True) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), weight [N, K] with unit last stride (x's dtype or another float
    dtype) -> y [M, N] in x's dtype, as reference.gemv_reference (float32 sums, rounded once).
    gated: x is gate | up [M, 2K] (unit last stride; a row stride of its own, e.g. columns of a
    packed projection's output) and the product is SiLU(gate) * up @ W^T, the SiLU computed as the
    input is loaded, rounded where ops.fused.silu_mul rounds (one launch fewer).
    block_n / block_k (a power-of-two multiple of 128) / split_k / num_warps / num_stages: the tile,
    defaults from pick_gemv_tile and 3 stages (benchmarks/bench_gemv.py sweeps them).
    sum_split=False: with K split, the float32 partials [split, M, N] themselves, for a consumer
    that adds them in plane order and rounds once (the sum kernel's result) as it reads them."""
    k = weight.shape[1] if weight.dim() == 2 else -1
    m = x.shape[0] if x.dim() == 2 else MAX_ROWS + 1
    if (m > MAX_ROWS or weight.dim() != 2 or weight.stride(-1) != 1 or x.shape[-1] != (2 * k if gated else k)
            or (gated and x.stride(-1) != 1)):
        raise ValueError(f"gemv: x [M <= {MAX_ROWS}, {'2K' if gated else 'K'}], weight [N, K] with unit last "
                         f"strides; got {tuple(x.shape)}, {tuple(weight.shape)}")
    n = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    bn, bk, split, warps = pick_gemv_tile(n, k, num_sms(x.device), weight.element_size())
    bn, bk, split, warps = block_n or bn, block_k or bk, split_k or split, num_warps or warps
    if bk % GROUP or bk & (bk - 1) or split < 1:
        raise ValueError(f"gemv: block_k a power-of-two multiple of {GROUP}, split_k >= 1; got {bk}, {split}")
    out = split_k_buffer(y, split)
    _gemv_kernel[(triton.cdiv(n, bn), split)](
        x, weight, _one(x.device), out, m, n, k, x.stride(0), weight.stride(0), out.stride(-2),
        out.stride(0) if split > 1 else 0, ROWS=triton.next_power_of_2(m), BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
        NUM_STAGES=num_stages, GATED=gated, num_warps=warps)
    if not sum_split and split > 1:
        return out
    sum_split_k(out, y, split)
    return y


__all__ = ["MAX_ROWS", "gemv", "pick_gemv_tile"]
