"""A hyper-connection step (reference.hc_step_reference) in three Triton kernels around the
three projection GEMMs, instead of ~25 small torch kernels: at batch 1 a Qwen4Exp decode step runs
two of these per layer, and their launches, not their bytes, were the cost.

  inject_norm_kernel (in ops/fused/triton_fused.py): hyper += inject[s] * out per stream (rounded
                like the torch add), then the grouped
                1-centred RMSNorm of the new hyper                       -> hyper', xn
  GEMMs:        d = xn @ down^T, i = xn @ inject^T (ops.gemv: the GEMV at decode rows, else cuBLAS;
                one GEMM where the two weights are rows of one packed parameter)
  _gate_acts:   d <- silu(d / hc); i <- 2 sigmoid(i / hc) (adding the GEMV's split-K partials
                itself where it split K: the GEMV's sum launch, gone)
  GEMM:         u = d @ up^T
  _mix_streams: mixed = mean_s(sigmoid(u_s) * xn_s)
                (at decode rows these three are one kernel, _up_mix_kernel: it activates the
                GEMM's raw rows as it loads them, and u never leaves registers)

Every intermediate is rounded to the model dtype where the torch path rounds (float32 math inside).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops import gemv
from qsaserve.ops.fused.triton_fused import inject_norm_kernel


# stride_plane (T * N) unspecialized: its divisibility by 16 differs between row counts
@triton.jit(do_not_specialize=["stride_plane"])
def _gate_acts_kernel(d_ptr, i_ptr, src_ptr, n_d, n_i, hc, stride_d, stride_i, stride_src, stride_plane,
                      HAS_INJECT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_I: tl.constexpr, SPLIT: tl.constexpr):
    """d <- silu(d / hc), i <- 2 sigmoid(i / hc), rounded as the torch path rounds. SPLIT 0: d and
    i in place; SPLIT s > 0: read from the stacked down | inject GEMV's float32 split-K partials
    src [s, T, n_d + n_i], added in plane order and rounded to the outputs' dtype (the GEMV's own
    sum, one launch fewer)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < n_d
    dt = d_ptr.dtype.element_ty
    if SPLIT > 0:
        acc = tl.load(src_ptr + row * stride_src + c, mask=ok, other=0.0)  # plane 0 as the sum kernel starts
        for p in tl.static_range(1, SPLIT):
            acc += tl.load(src_ptr + p * stride_plane + row * stride_src + c, mask=ok, other=0.0)
        d = acc.to(dt)
    else:
        d = tl.load(d_ptr + row * stride_d + c, mask=ok, other=0.0)
    a = (d.to(tl.float32) / hc).to(dt).to(tl.float32)  # the torch path rounds after / hc
    tl.store(d_ptr + row * stride_d + c, (a * tl.sigmoid(a)).to(dt), mask=ok)
    if HAS_INJECT:
        j = tl.arange(0, BLOCK_I)
        jok = j < n_i
        if SPLIT > 0:
            acc_i = tl.load(src_ptr + row * stride_src + n_d + j, mask=jok, other=0.0)
            for p in tl.static_range(1, SPLIT):
                acc_i += tl.load(src_ptr + p * stride_plane + row * stride_src + n_d + j, mask=jok, other=0.0)
            i = acc_i.to(dt)
        else:
            i = tl.load(i_ptr + row * stride_i + j, mask=jok, other=0.0)
        b = (i.to(tl.float32) / hc).to(dt).to(tl.float32)
        sig = tl.sigmoid(b).to(dt).to(tl.float32)
        tl.store(i_ptr + row * stride_i + j, (2.0 * sig).to(dt), mask=jok)


@triton.jit
def _mix_streams_kernel(u_ptr, xn_ptr, mixed_ptr, H, stride_u, stride_x, stride_m,
                        HC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    c = blk * BLOCK + tl.arange(0, BLOCK)
    ok = c < H
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(HC):
        u = tl.load(u_ptr + row * stride_u + s * H + c, mask=ok, other=0.0)
        xn = tl.load(xn_ptr + row * stride_x + s * H + c, mask=ok, other=0.0)
        gate = tl.sigmoid(u.to(tl.float32)).to(u.dtype)
        acc += (gate.to(tl.float32) * xn.to(tl.float32)).to(u.dtype).to(tl.float32)
    tl.store(mixed_ptr + row * stride_m + c, (acc / HC).to(mixed_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gemm_row(src_ptr, r, stride_s, stride_plane, c, ok, SPLIT: tl.constexpr, dt):
    """Row r, columns c, of a GEMM's output in dt (SPLIT 0), or of its float32 split-K partials
    (SPLIT planes, added in plane order and rounded to dt, as the GEMV's own sum), as float32."""
    if SPLIT > 0:
        acc = tl.load(src_ptr + r * stride_s + c, mask=ok, other=0.0)
        for p in tl.static_range(1, SPLIT):
            acc += tl.load(src_ptr + p * stride_plane + r * stride_s + c, mask=ok, other=0.0)
        return acc.to(dt).to(tl.float32)
    return tl.load(src_ptr + r * stride_s + c, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _mix_row(w, dr, xn, HC: tl.constexpr, dt):
    """A block-input row at a program's columns: mean over the streams of sigmoid(u) * xn with
    u = dr @ w^T (w [HC_POW2, COLS, BLOCK_K], the streams' up rows; dr [BLOCK_K] the activated
    down row; xn [HC_POW2, COLS], zero past HC), u, the sigmoid and each product rounded to dt as
    the unjoined path rounds."""
    u = tl.sum(w * dr[None, None, :], 2).to(dt)
    gate = tl.sigmoid(u.to(tl.float32)).to(dt)
    terms = (gate.to(tl.float32) * xn).to(dt).to(tl.float32)
    return (tl.sum(terms, 0) / HC).to(dt)


@triton.jit(do_not_specialize=["stride_plane"])
def _up_mix_kernel(src_ptr, w_ptr, xn_ptr, mixed_ptr, inj_ptr, H, K, n_i, hc_f,
                   stride_s, stride_plane, stride_w, stride_x, stride_m, stride_i,
                   HC: tl.constexpr, HC_POW2: tl.constexpr, COLS: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_I: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr, ACTIVATE: tl.constexpr,
                   HAS_INJECT: tl.constexpr):
    """Decode rows (ROWS <= UP_MIX_ROWS): the up projection and the stream mix in one launch, each
    program COLS columns of the block input over all HC streams. The streams' up rows s * H + c
    come in one [HC, COLS, K] load (all of a program's bytes in flight at once: loading stream by
    stream put a reduction's barrier between the loads, ~0.55 TB/s), read once for every row,
    without u's round trip or the mix launch. u's float32 sum runs in another order than the
    GEMV's, and the streams' terms are added as a tree, so the result may differ from the
    unjoined path by a rounding step. K <= BLOCK_K.
    src: the activated down rows d [T, K] (ACTIVATE off), or (ACTIVATE) the down | inject GEMM's
    output (its first K columns the down projection, the next n_i the injection logits; SPLIT > 0:
    its float32 split-K partials), which each program activates as _gate_acts_kernel does
    (silu(d / hc)); program 0 also stores the injection weights 2 sigmoid(i / hc) (HAS_INJECT).
    That is the activation launch of the unjoined path, gone."""
    dt = mixed_ptr.dtype.element_ty
    s = tl.arange(0, HC_POW2)
    c = tl.program_id(0) * COLS + tl.arange(0, COLS)
    k = tl.arange(0, BLOCK_K)
    s_ok = s < HC
    c_ok = c < H
    k_ok = k < K
    rows = (s[:, None] * H + c[None, :]).to(tl.int64)  # [HC_POW2, COLS]
    rc_ok = s_ok[:, None] & c_ok[None, :]
    w = tl.load(w_ptr + rows[:, :, None] * stride_w + k[None, None, :],
                mask=rc_ok[:, :, None] & k_ok[None, None, :], other=0.0).to(tl.float32)
    for r in tl.static_range(ROWS):
        dr = _gemm_row(src_ptr, r, stride_s, stride_plane, k, k_ok, SPLIT, dt)
        if ACTIVATE:
            a = (dr / hc_f).to(dt).to(tl.float32)  # the torch path rounds after / hc
            dr = (a * tl.sigmoid(a)).to(dt).to(tl.float32)
        xn = tl.load(xn_ptr + r * stride_x + rows, mask=rc_ok, other=0.0).to(tl.float32)
        tl.store(mixed_ptr + r * stride_m + c, _mix_row(w, dr, xn, HC, dt), mask=c_ok)
        if HAS_INJECT:
            j = tl.arange(0, BLOCK_I)
            j_ok = (j < n_i) & (tl.program_id(0) == 0)
            b = (_gemm_row(src_ptr, r, stride_s, stride_plane, K + j, j_ok, SPLIT, dt) / hc_f).to(dt).to(tl.float32)
            sig = tl.sigmoid(b).to(dt).to(tl.float32)
            tl.store(inj_ptr + r * stride_i + j, (2.0 * sig).to(dt), mask=j_ok)


UP_MIX_ROWS = 4  # decode rows the joined up + mix kernel serves (ops.gemv.MAX_ROWS)
UP_MIX_MAX_K = 1024  # hc_lowrank it holds in one tile (the real model's 320)
# block-input columns and warps a program: 1,024 programs at H = 2,048, each HC x 2 weight rows
# (benchmarks/bench_hc.py on an H200, bench_hc_h200_2026-12-06_829651f.json: qwen4exp-small's
# 5.2 MB up weight in 4.15 / 4.55 / 5.89 us at 1 / 2 / 4 rows against 4.13 / 5.35 / 7.94 at 4
# columns over 4 warps and the unjoined up GEMV + mix kernel's 6.03 / 7.33 / 8.81)
UP_MIX_COLS = 2
UP_MIX_WARPS = 1


def _joins_up_mix(xn: torch.Tensor, up_weight: torch.Tensor) -> bool:
    """Whether the up projection takes the joined kernel: the GEMV could run it (ops.gemv.runs_gemv:
    dtypes, device, the switch) and it fits the kernel's rows and K (at 3-4 rows too, where a
    plain GEMV of this shape loses to cuBLAS but the joined kernel beats cuBLAS + the mix)."""
    k = up_weight.shape[1] if up_weight.dim() == 2 else UP_MIX_MAX_K + 1
    return gemv.runs_gemv(xn[:, :k], up_weight) and xn.shape[0] <= UP_MIX_ROWS and k <= UP_MIX_MAX_K


def up_mix_joined(src: torch.Tensor, up_weight: torch.Tensor, xn: torch.Tensor, hc_count: int,
                  activate: bool = False, inject: torch.Tensor | None = None, cols: int = UP_MIX_COLS,
                  num_warps: int = UP_MIX_WARPS) -> torch.Tensor:
    """The joined kernel's launch -> mixed [T, H]. up_weight [hc * H, K] (K <= UP_MIX_MAX_K), xn
    [T, hc * H], T <= UP_MIX_ROWS. src: the activated down rows [T, K] (activate False), or the
    down (| inject) GEMM's raw output [T, K (+ hc)] or its float32 split-K partials [S, T, ...]
    (activate True: silu(d / hc) computed as loaded); inject [T, hc]: receives 2 sigmoid(i / hc)
    of the GEMM's columns K.. (activate only). cols / num_warps: a program's columns and warps
    (benchmarks/bench_hc.py sweeps them)."""
    t, k = xn.shape[0], up_weight.shape[1]
    h = up_weight.shape[0] // hc_count
    split = src.shape[0] if src.dim() == 3 else 0
    if src.stride(-1) != 1 or (inject is not None and not activate):
        raise ValueError("up_mix_joined: src needs a unit last stride; inject only with activate")
    mixed = torch.empty((t, h), dtype=xn.dtype, device=xn.device)
    _up_mix_kernel[(triton.cdiv(h, cols),)](
        src, up_weight, xn, mixed, inject if inject is not None else mixed, h, k, hc_count, float(hc_count),
        src.stride(-2), src.stride(0) if split else 0, up_weight.stride(0), xn.stride(0), mixed.stride(0),
        inject.stride(0) if inject is not None else 0,
        HC=hc_count, HC_POW2=triton.next_power_of_2(hc_count), COLS=cols, BLOCK_K=triton.next_power_of_2(k),
        BLOCK_I=triton.next_power_of_2(hc_count), ROWS=t, SPLIT=split, ACTIVATE=activate,
        HAS_INJECT=inject is not None, num_warps=num_warps)
    return mixed


def _stacked(a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor | None:
    """a [Na, K] and b [Nb, K] as one [Na + Nb, K] view where both are views of one storage and
    b's rows follow a's (a packed parameter's parts), else None (separate tensors may also lie
    side by side in memory: not one storage, not one view)."""
    if (b is None or a.dim() != 2 or a.stride() != b.stride() or a.stride(-1) != 1 or a.shape[1] != b.shape[1]
            or a.dtype != b.dtype or a.device != b.device
            or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
            or b.storage_offset() != a.storage_offset() + a.shape[0] * a.stride(0)):
        return None
    return a.as_strided((a.shape[0] + b.shape[0], a.shape[1]), a.stride())


def hc_step_triton(hyper: torch.Tensor, block_out: torch.Tensor | None, inject: torch.Tensor | None,
                   norm_weight: torch.Tensor, down_weight: torch.Tensor, up_weight: torch.Tensor,
                   inject_weight: torch.Tensor | None, hc_count: int, eps: float):
    """Same contract as reference.hc_step_reference; hyper [T, hc*H] (unit last stride)."""
    if hyper.stride(-1) != 1:
        hyper = hyper.contiguous()
    if block_out is not None and (block_out.stride(-1) != 1 or inject.stride(-1) != 1):
        block_out, inject = block_out.contiguous(), inject.contiguous()
    t, width = hyper.shape
    h = width // hc_count
    block = triton.next_power_of_2(h)
    new = torch.empty_like(hyper) if block_out is not None else hyper
    xn = torch.empty_like(hyper)
    if t:
        inject_norm_kernel[(t, hc_count)](
            hyper, block_out if block_out is not None else hyper, inject if inject is not None else hyper,
            norm_weight, new, xn, h, eps, hyper.stride(0),
            block_out.stride(0) if block_out is not None else 0, inject.stride(0) if inject is not None else 0,
            new.stride(0), xn.stride(0), HAS_OUT=block_out is not None, BLOCK=block,
            num_warps=8 if block >= 4096 else 4)
    stacked = _stacked(down_weight, inject_weight)
    n_d = down_weight.shape[0]
    joins = bool(t) and _joins_up_mix(xn, up_weight)
    if joins and (stacked is not None or inject_weight is None):
        # decode rows: the activations join the up + mix kernel, which reads the GEMM's output (or
        # its split-K partials) raw
        raw = gemv.linear_partials(xn, stacked if stacked is not None else down_weight)
        i = torch.empty((t, hc_count), dtype=hyper.dtype, device=hyper.device) if stacked is not None else None
        return new, up_mix_joined(raw, up_weight, xn, hc_count, activate=True, inject=i), i
    src, split = hyper, 0
    if stacked is not None:  # one GEMM for both, then views of its columns
        di = gemv.linear_partials(xn, stacked)
        if di.dim() == 3:  # split-K partials: the activations below add them up
            src, split = di, di.shape[0]
            d = torch.empty((t, n_d), dtype=hyper.dtype, device=hyper.device)
            i = torch.empty((t, hc_count), dtype=hyper.dtype, device=hyper.device)
        else:
            d, i = di[:, :n_d], di[:, n_d:]
    else:
        d = gemv.linear(xn, down_weight)
        i = gemv.linear(xn, inject_weight) if inject_weight is not None else None
    if t:
        _gate_acts_kernel[(t,)](d, i if i is not None else d, src, n_d, hc_count, float(hc_count), d.stride(0),
                                i.stride(0) if i is not None else 0, src.stride(-2) if split else 0,
                                src.stride(0) if split else 0, HAS_INJECT=i is not None,
                                BLOCK=triton.next_power_of_2(n_d), BLOCK_I=triton.next_power_of_2(hc_count),
                                SPLIT=split, num_warps=4)
    if joins and d.stride(-1) == 1:  # separate down and inject weights: d activated above
        return new, up_mix_joined(d, up_weight, xn, hc_count), i
    u = gemv.linear(d, up_weight)
    mixed = torch.empty((t, h), dtype=hyper.dtype, device=hyper.device)
    if t:
        bm = min(1024, block)
        _mix_streams_kernel[(t, triton.cdiv(h, bm))](u, xn, mixed, h, u.stride(0), xn.stride(0), mixed.stride(0),
                                                      HC=hc_count, BLOCK=bm, num_warps=4)
    return new, mixed, i
