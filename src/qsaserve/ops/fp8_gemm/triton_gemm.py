"""FP8-weight GEMMs: y [M, N] = x [M, K] @ W^T with W E4M3 [N, K] and float32 scales
[Sn, Sk] (reference.py's layout; K blocks of 128 = GROUP).

* `fp8_w8a8_gemm_triton` (prefill, > DECODE_ROWS rows, where cuBLAS's block-scaled GEMM does not
  take them): the activations come quantized per token
  and 128-group (triton_quant.py); each K step is one FP8 tensor-core dot of a 128-deep tile,
  scaled by the activation's group scale per row and the weight's block scale per column, summed
  in float32 (vLLM's `w8a8_block_fp8_matmul` scheme).
* `fp8_w8a16_gemm_triton` (decode, 1-64 rows, under QSASERVE_FP8_DECODE_KERNEL=tile): activations stay bf16 (no quantization kernel, no
  extra error on the path a token's latency waits on); each program streams BLOCK_N weight rows
  once as E4M3 (1 byte a weight: the step's whole cost) and widens them to the activation dtype
  in registers. The grid has one program per BLOCK_N rows (pick_decode_block_n) and, with
  split_k > 1, split_k programs per row block over contiguous 128-column ranges of K, whose
  float32 partial sums a second kernel adds in a fixed order (deterministic).

Scales with Sk == 1 (per-channel, per-tensor) are read with a zero K stride."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.device import max_shared_bytes, num_sms
from qsaserve.ops.fp8_gemm.reference import GROUP


@triton.jit
def e4m3_dot(a, b, EXACT: tl.constexpr):
    """tl.dot of two E4M3 tiles, float32 result. Hopper's FP8 MMA adds its products at reduced
    precision (a W8A8 GEMM of float32 output was 2-3e-4 relative off the reference on an H200);
    EXACT (float32 models: the CPU comparisons) multiplies the same E4M3 values, exact in fp16, on
    fp16 MMAs, which accumulate in float32 as the reference does. bf16 / fp16 models keep FP8."""
    if EXACT:
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    return tl.dot(a, b)


@triton.jit
def _w8a8_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, block_n,
                 stride_am, stride_asm, stride_bn, stride_bsn, stride_bsk, stride_cm,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 EXACT: tl.constexpr):
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    # grouped ordering: GROUP_M row blocks share each weight column block while it sits in L2
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
    bs_ptrs = bs_ptr + (offs_n // block_n) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=m_ok, other=0.0)
        b_s = tl.load(bs_ptrs + kb * stride_bsk, mask=n_ok, other=0.0)
        acc += e4m3_dot(a, b, EXACT) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, block_n,
                  stride_xm, stride_wn, stride_sn, stride_sk, stride_ym, stride_ys,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_UNROLL: tl.constexpr,
                  SPLIT_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    s_rows = s_ptr + (offs_n // block_n) * stride_sn
    y_rows = y_ptr
    if SPLIT_K == 1:
        blk_lo = 0
        n_iter = tl.cdiv(K, BLOCK_K * K_UNROLL)
    else:  # program pid_k: 128-column blocks [pid_k * nkb // SPLIT_K, (pid_k + 1) * nkb // SPLIT_K)
        pid_k = tl.program_id(2)
        nkb = tl.cdiv(K, BLOCK_K)
        blk_lo = pid_k * nkb // SPLIT_K
        blk_hi = (pid_k + 1) * nkb // SPLIT_K
        n_iter = tl.cdiv(blk_hi - blk_lo, K_UNROLL)
        y_rows += pid_k.to(tl.int64) * stride_ys  # its float32 partial sums, plane pid_k of [SPLIT_K, M, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K_UNROLL independent 128-column steps per iteration: more weight bytes in flight per program,
    # each step still scaled by its own block scale after its dot
    for kb in range(0, n_iter):
        for j in tl.static_range(K_UNROLL):
            blk = blk_lo + kb * K_UNROLL + j
            k0 = blk * BLOCK_K
            k_ok = offs_k < K - k0
            s_ok = n_ok & (k0 < K)
            if SPLIT_K > 1:  # steps past this program's range (its last iteration) read nothing
                k_ok = k_ok & (blk < blk_hi)
                s_ok = s_ok & (blk < blk_hi)
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + (k0 + offs_k)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            s = tl.load(s_rows + blk * stride_sk, mask=s_ok, other=0.0)
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION) * s[None, :]  # exact: E4M3 fits bf16
    y_ptrs = y_rows + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _split_k_sum_kernel(p_ptr, y_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """y [numel] = sum over s = 0, 1, ... SPLIT_K - 1 of p [SPLIT_K, numel] (float32, in that
    order: deterministic), rounded once to y's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    p = p_ptr + offs
    acc = tl.load(p, mask=ok, other=0.0)
    for _ in tl.static_range(1, SPLIT_K):
        p += numel
        acc += tl.load(p, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def split_k_buffer(y: torch.Tensor, split_k: int) -> torch.Tensor:
    """Where a split-K launch writes: y itself with one split, else a float32 [split_k, M, N]
    workspace of partial sums (one plane per K range)."""
    return y if split_k == 1 else torch.empty((split_k, *y.shape), dtype=torch.float32, device=y.device)


def sum_split_k(out: torch.Tensor, y: torch.Tensor, split_k: int) -> None:
    """split_k_buffer's planes added into y in a fixed order, rounded once (nothing with one split)."""
    if split_k > 1:
        block = 1024
        _split_k_sum_kernel[(triton.cdiv(y.numel(), block),)](out, y, y.numel(), SPLIT_K=split_k, BLOCK=block,
                                                              num_warps=4)


def _check(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int, what: str) -> None:
    m, k = x.shape
    n = w.shape[0]
    sk = w_scale.shape[1]
    if (w.shape[1] != k or w.stride(-1) != 1 or w_scale.dim() != 2 or block_n < 1
            or w_scale.shape[0] != triton.cdiv(n, block_n) or sk not in (1, triton.cdiv(k, GROUP))):
        raise ValueError(f"{what}: x [M, K], w [N, K] (unit last stride), w_scale [ceil(N/block_n), 1 or "
                         f"ceil(K/{GROUP})]; got {tuple(x.shape)}, {tuple(w.shape)}, {tuple(w_scale.shape)}, "
                         f"block_n {block_n}")


def w8a16_operands(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
                   what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The W8A16 kernels' argument check (_check) -> (x with a unit last stride, the output y
    [M, N] in x's dtype)."""
    _check(x, w, w_scale, block_n, what)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x, torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)


def _scale_k_stride(w_scale: torch.Tensor) -> int:
    return 0 if w_scale.shape[1] == 1 else w_scale.stride(1)


def fp8_w8a8_gemm_triton(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         block_n: int, out_dtype: torch.dtype, block_m: int | None = None, block_n_tile: int = 128,
                         num_warps: int | None = None, num_stages: int = 3) -> torch.Tensor:
    """xq [M, K] E4M3, x_scale [M, ceil(K/128)] float32, w [N, K] E4M3, w_scale [Sn, Sk] ->
    [M, N] in out_dtype, as reference.fp8_w8a8_gemm_reference. block_m / block_n_tile / num_warps /
    num_stages: the tile (default 64 x 128 with 4 warps up to 128 rows, 128 x 128 with 8 above;
    the benchmark sweeps them)."""
    _check(xq, w, w_scale, block_n, "fp8_w8a8_gemm")
    m, k = xq.shape
    block_m = block_m or (64 if m <= 128 else 128)
    num_warps = num_warps or (4 if block_m == 64 else 8)
    n = w.shape[0]
    if xq.stride(-1) != 1:
        xq = xq.contiguous()
    y = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return y
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n_tile),)
    _w8a8_kernel[grid](xq, x_scale, w, w_scale, y, m, n, k, block_n, xq.stride(0), x_scale.stride(0), w.stride(0),
                       w_scale.stride(0), _scale_k_stride(w_scale), y.stride(0), BLOCK_M=block_m,
                       BLOCK_N=block_n_tile, BLOCK_K=GROUP, GROUP_M=8, EXACT=out_dtype == torch.float32,
                       num_warps=num_warps, num_stages=num_stages)
    return y


def pick_decode_block_n(n: int, sms: int, block_m: int = 16) -> int:
    """The weight-row block of a W8A16 launch. Up to 32 rows (BLOCK_M <= 32): 32 weight rows, or 16
    where N / 32 programs would leave over half the SMs idle. At BLOCK_M 64: 16. From bench_fp8_gemm on an H200
    (fp8_gemm_h200_2026-12-02_7d86c33.json, llama-8b's four projections, 4 x 128-deep steps,
    3 stages): at 1-16 rows BLOCK_N 32 read 27-53% of the HBM bandwidth against 14-15% for the
    16 that "two programs per SM" gave qkv, o and down and 44-45% for the 64 it gave gate_up; at
    64 rows 16 (with one step, pick_decode_unroll) led at 16-19% (the kernel is far from the
    bandwidth either way: docs/weight_quantization.md)."""
    if block_m <= 32 and 2 * triton.cdiv(n, 32) >= sms:  # o and down's N = 4096: 128 programs, 132 SMs
        return 32
    return 16


def decode_block_m(m: int) -> int:
    """The W8A16 row block: tl.dot needs 16 rows (padding rows are masked), at most 64."""
    return max(16, min(64, triton.next_power_of_2(m)))


def w8a16_shared_bytes(block_m: int, block_n: int, k_unroll: int, num_stages: int, x_bytes: int) -> int:
    """Shared memory the sm_90 compile of _w8a16_kernel takes (x of x_bytes per element, 4 warps).
    The pipeliner keeps num_stages - 1 iterations of loads in flight, each the x and E4M3 weight
    tiles of its K_UNROLL steps; on top: one step's weight tile widened to x's dtype (the dot
    operand's layout change) and, at BLOCK_M = 64 with 16-bit x (wgmma, both operands from shared
    memory), a copy of the iteration's x tiles. Measured with tests/triton_compile_check (Triton
    3.6, the GPU JIT's divisibility attrs) over BLOCK_M 16/32/64 x BLOCK_N 16-128 x K_UNROLL 1/2/4
    x 2-4 stages with bf16 x, and BLOCK_M 16/32 (one point at 64) with fp32 x: exact at BLOCK_M 64
    and for fp32 x, else over by at most BLOCK_N * 256 bytes, never on the wrong side of the
    sm_90 limit. E.g. 64 x 64 rows, 4 x 128-deep steps, 3 stages: 278528 (the launch the H200
    refused); 64 x 128, 2 steps, 3 stages: 196608; 16 x 128, 4 steps, 3 stages: 164352 measured,
    196608 here (tests/ops/test_fp8_gemm_triton.py holds the measurements)."""
    stage = k_unroll * GROUP * (block_m * x_bytes + block_n)
    wgmma = block_m >= 64 and x_bytes <= 2  # fp32 x (input_precision "ieee") takes FMA dots
    extra = GROUP * block_n * x_bytes + (k_unroll * GROUP * block_m * x_bytes if wgmma else 0)
    return (num_stages - 1) * stage + extra


def pick_decode_unroll(block_m: int, block_n: int, x_bytes: int, max_shared: int,
                       k_unroll: int | None = None, num_stages: int | None = None) -> tuple[int, int]:
    """(k_unroll, num_stages) for a W8A16 tile, the ones given kept: 4 steps an iteration and 3
    stages (the kernel's fixed defaults before) where w8a16_shared_bytes fits max_shared, else
    half the steps, then fewer stages, until it does. On sm_90 (232448 bytes) with bf16 x only
    BLOCK_M = 64 drops below 4 steps: to 2 at BLOCK_N >= 32 (4 steps need 237568 bytes at
    BLOCK_N = 32, 278528 at 64, 360448 at 128); fp32 x (tests) drops at BLOCK_N 128 and BLOCK_M 64.
    Halving the steps before the stages keeps as many bytes in flight as 4 steps x 2 stages
    (which of the two is faster at 33-64 rows is not measured)."""
    def fits(ku: int, ns: int) -> bool:
        return w8a16_shared_bytes(block_m, block_n, ku, ns, x_bytes) <= max_shared

    if k_unroll is None:
        k_unroll = 4
        while k_unroll > 1 and not fits(k_unroll, num_stages or 3):
            k_unroll //= 2
    if num_stages is None:
        num_stages = 3
        while num_stages > 1 and not fits(k_unroll, num_stages):
            num_stages -= 1
    return k_unroll, num_stages


def pick_decode_split_k(n: int, k: int, block_n: int, sms: int) -> int:
    """A PROPOSAL, not measured (fp8_w8a16_gemm_triton's default stays split_k = 1; the
    fp8_w8a16_rule rows of benchmarks/bench_fp8_gemm.py time it against split_k 1/2/4/8): the
    fewest K splits in 1, 2, 4, 8 that give at least 3 programs per SM (the 16/32 x 32 tile at 4 x
    128-deep steps and 3 stages takes ~72 KiB of shared memory: 3 fit an SM), without cutting K
    below 8 blocks of 128 (two 4-step iterations, so the loads still pipeline) a program; the
    largest split within that depth when none reaches 3 per SM. llama-8b's projections at BLOCK_N 32
    on 132 SMs: qkv (192 programs), o and down (128) 4, gate_up (896) 1."""
    programs = triton.cdiv(n, block_n)
    split = 1
    while split < 8 and programs * split < 3 * sms and triton.cdiv(k, GROUP) // (2 * split) >= 8:
        split *= 2
    return split


def fp8_w8a16_gemm_triton(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block_n: int,
                          block_n_tile: int | None = None, k_unroll: int | None = None, num_warps: int = 4,
                          num_stages: int | None = None, split_k: int = 1) -> torch.Tensor:
    """x [M, K] bf16/fp16/fp32, w [N, K] E4M3, w_scale [Sn, Sk] -> [M, N] in x's dtype, as
    reference.fp8_w8a16_gemm_reference. Meant for M <= 64 (one row block); larger M runs, as more
    row blocks re-reading the weights. block_n_tile / k_unroll / num_warps / num_stages: the tile
    (benchmarks/bench_fp8_gemm.py sweeps them); k_unroll and num_stages left None come from
    pick_decode_unroll, so the tile fits the device's shared memory (given ones are used as is).

    split_k > 1: the grid gets a third axis of split_k programs per tile, each over a contiguous
    range of whole 128-column blocks (ceil(K/128) blocks shared out as evenly as they go: sizes
    differ by at most one; a program with none writes zeros), writing its float32 partial sums to
    its plane of a [split_k, M, N] workspace; a second kernel adds the planes in a fixed order and
    rounds once to x's dtype. Deterministic (no atomics) and CUDA-graph safe (no host sync, shapes
    from the arguments only); costs 2 x split_k x M x N x 4 bytes of workspace traffic (L2-sized at
    decode rows) and one more launch. pick_decode_split_k proposes a split_k."""
    x, y = w8a16_operands(x, w, w_scale, block_n, "fp8_w8a16_gemm")
    if split_k < 1:
        raise ValueError(f"fp8_w8a16_gemm: split_k must be >= 1, got {split_k}")
    m, k = x.shape
    n = w.shape[0]
    if m == 0 or n == 0:
        return y
    block_m = decode_block_m(m)
    bn = block_n_tile or pick_decode_block_n(n, num_sms(x.device), block_m)
    if k_unroll is None and block_m == 64 and block_n_tile is None:
        k_unroll = 1  # measured best at 64 rows (pick_decode_block_n)
    if k_unroll is None or num_stages is None:
        k_unroll, num_stages = pick_decode_unroll(block_m, bn, x.element_size(), max_shared_bytes(x.device),
                                                  k_unroll, num_stages)
    out = split_k_buffer(y, split_k)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, block_m), split_k)
    _w8a16_kernel[grid](x, w, w_scale, out, m, n, k, block_n, x.stride(0), w.stride(0), w_scale.stride(0),
                        _scale_k_stride(w_scale), out.stride(-2), out.stride(0) if split_k > 1 else 0,
                        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=GROUP, K_UNROLL=k_unroll, SPLIT_K=split_k,
                        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                        num_warps=num_warps, num_stages=num_stages)
    sum_split_k(out, y, split_k)
    return y


__all__ = ["decode_block_m", "fp8_w8a16_gemm_triton", "fp8_w8a8_gemm_triton", "pick_decode_block_n",
           "pick_decode_split_k", "pick_decode_unroll", "w8a16_shared_bytes"]
