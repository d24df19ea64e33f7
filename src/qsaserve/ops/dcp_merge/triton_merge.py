"""Triton versions of `reference.pack_partials`, `merge_packed` and `scale_partials`: one launch
each where the torch versions take 5-12 small kernels, for every QSA layer of every DCP decode
step. Same contracts (see reference.py); fp32 throughout."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T"])
def _pack_kernel(out_ptr, lse_ptr, packed_ptr, T, HL, DH,
                 stride_ot, stride_oh, stride_lt, stride_pj, stride_pt, stride_ph, DH_POW2: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)  # group head: rank j = h // HL, its head h % HL
    c = tl.arange(0, DH_POW2)
    row = tl.load(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + c, mask=c < DH, other=0.0)
    lse = tl.load(lse_ptr + t.to(tl.int64) * stride_lt + h)
    dst = packed_ptr + (h // HL).to(tl.int64) * stride_pj + t.to(tl.int64) * stride_pt + (h % HL) * stride_ph
    tl.store(dst + c, tl.where(c < DH, row, lse), mask=c <= DH)


@triton.jit
def _merge_kernel(recv_ptr, out_ptr, D, DH, stride_rj, stride_rt, stride_rh, stride_ot, stride_oh,
                  D_POW2: tl.constexpr, DH_POW2: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.arange(0, D_POW2)
    c = tl.arange(0, DH_POW2)
    base = recv_ptr + j.to(tl.int64) * stride_rj + t.to(tl.int64) * stride_rt + h * stride_rh  # [D_POW2] row starts
    lse = tl.load(base + DH, mask=j < D, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - m), 0.0)
    total = tl.sum(w, 0)
    o = tl.load(base[:, None] + c[None, :], mask=((j < D) & (w > 0.0))[:, None] & (c < DH)[None, :], other=0.0)
    merged = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + c, merged, mask=c < DH)


@triton.jit
def _scale_kernel(out_ptr, lse_ptr, lses_ptr, send_ptr, D, HL, DH,
                  stride_ot, stride_oh, stride_lt, stride_gj, stride_gt, stride_sj, stride_st, stride_sh,
                  D_POW2: tl.constexpr, DH_POW2: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.arange(0, D_POW2)
    c = tl.arange(0, DH_POW2)
    lses = tl.load(lses_ptr + j.to(tl.int64) * stride_gj + t.to(tl.int64) * stride_gt + h, mask=j < D, other=float("-inf"))
    m = tl.max(lses, 0)
    m = tl.where(m > float("-inf"), m, 0.0)
    total = tl.sum(tl.where(lses > float("-inf"), tl.exp2(lses - m), 0.0), 0)
    mine = tl.load(lse_ptr + t.to(tl.int64) * stride_lt + h)
    w = tl.where(mine > float("-inf"), tl.exp2(mine - m), 0.0) / tl.maximum(total, 1.1754943508222875e-38)
    w_row = tl.zeros([DH_POW2], tl.float32) + w  # as a row: the masks below are elementwise
    row = tl.load(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + c, mask=(c < DH) & (w_row > 0.0), other=0.0)
    dst = send_ptr + (h // HL).to(tl.int64) * stride_sj + t.to(tl.int64) * stride_st + (h % HL) * stride_sh
    tl.store(dst + c, row * w_row, mask=c < DH)


def pack_partials_triton(out: torch.Tensor, lse: torch.Tensor, d: int) -> torch.Tensor:
    out, lse = out.contiguous(), lse.contiguous()  # no copies for the sparse kernel's outputs
    t, hg, dh = out.shape
    packed = torch.empty((d, t, hg // d, dh + 1), dtype=torch.float32, device=out.device)
    if t:
        _pack_kernel[(t, hg)](out, lse, packed, t, hg // d, dh, out.stride(0), out.stride(1), lse.stride(0),
                              packed.stride(0), packed.stride(1), packed.stride(2),
                              DH_POW2=triton.next_power_of_2(dh + 1), num_warps=1 if dh < 256 else 2)
    return packed


def merge_packed_triton(recv: torch.Tensor) -> torch.Tensor:
    recv = recv.contiguous()
    d, t, hl, dh1 = recv.shape
    out = torch.empty((t, hl, dh1 - 1), dtype=torch.float32, device=recv.device)
    if t:
        _merge_kernel[(t, hl)](recv, out, d, dh1 - 1, recv.stride(0), recv.stride(1), recv.stride(2),
                               out.stride(0), out.stride(1), D_POW2=max(2, triton.next_power_of_2(d)),
                               DH_POW2=triton.next_power_of_2(dh1 - 1), num_warps=2)
    return out


def scale_partials_triton(out: torch.Tensor, lse: torch.Tensor, lses: torch.Tensor, d: int) -> torch.Tensor:
    out, lse, lses = out.contiguous(), lse.contiguous(), lses.contiguous()
    t, hg, dh = out.shape
    send = torch.empty((d, t, hg // d, dh), dtype=torch.float32, device=out.device)
    if t:
        _scale_kernel[(t, hg)](out, lse, lses, send, d, hg // d, dh, out.stride(0), out.stride(1), lse.stride(0),
                               lses.stride(0), lses.stride(1), send.stride(0), send.stride(1), send.stride(2),
                               D_POW2=max(2, triton.next_power_of_2(d)), DH_POW2=triton.next_power_of_2(dh),
                               num_warps=2)
    return send
