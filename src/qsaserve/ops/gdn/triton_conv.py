"""Triton prefill conv of the GDN layers: the depthwise causal conv1d over every packed sequence of
a step in one launch, each continuing from its conv state, and its new state in a second one.

`causal_conv1d_reference` (reference.py) is the contract: same arguments, same results. The
reference loops over the sequences on the host (reading cu_seqlens back, a device sync), copies
each state ++ chunk and runs fp32 `conv1d` on it; here a program computes a [BLOCK_T, BLOCK_C]
tile of outputs straight from the packed input, taking the taps that fall before its
sequence's first token from that sequence's state. Accumulation in fp32, as the reference.
Nothing is read back to the host: the launch sizes come from tensor shapes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from qsaserve.ops.gdn.reference import conv1d_arguments


@triton.jit(do_not_specialize=["T", "C"])
def _conv_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, seq_ptr, cu_ptr, y_ptr,
    T, C,
    stride_xb, stride_xc, stride_xt, stride_wc, stride_sn, stride_sc, stride_ss,
    stride_yb, stride_yc, stride_yt,
    W: tl.constexpr, S: tl.constexpr, VARLEN: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    tb, cb, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok, c_ok = t < T, c < C
    if VARLEN:  # packed sequences in batch row 0: each row's sequence and its first row
        seq = tl.load(seq_ptr + t, mask=t_ok, other=0).to(tl.int64)
        start = tl.load(cu_ptr + seq, mask=t_ok, other=0).to(tl.int64)
    else:
        seq = tl.zeros([BLOCK_T], tl.int64) + b
        start = tl.zeros([BLOCK_T], tl.int64)
    rel = t.to(tl.int64) - start  # position inside the chunk
    x_row = x_ptr + b.to(tl.int64) * stride_xb
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    ok = t_ok[:, None] & c_ok[None, :]
    for j in tl.static_range(W):
        src = rel - (W - 1) + j  # < 0: a tap on the state (the inputs before the chunk)
        wj = tl.load(w_ptr + c * stride_wc + j, mask=c_ok, other=0.0).to(tl.float32)
        in_chunk = src >= 0
        xv = tl.load(x_row + (start + src)[:, None] * stride_xt + c[None, :] * stride_xc,
                     mask=ok & in_chunk[:, None], other=0.0)
        sv = tl.load(state_ptr + seq[:, None] * stride_sn + c[None, :] * stride_sc + (S + src)[:, None] * stride_ss,
                     mask=ok & (~in_chunk)[:, None], other=0.0)
        acc += wj[None, :] * tl.where(in_chunk[:, None], xv.to(tl.float32), sv.to(tl.float32))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    y = y_ptr + b.to(tl.int64) * stride_yb + t.to(tl.int64)[:, None] * stride_yt + c[None, :] * stride_yc
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["T", "C"])
def _state_kernel(
    x_ptr, state_ptr, cu_ptr, out_ptr,
    T, C,
    stride_xb, stride_xc, stride_xt, stride_sn, stride_sc, stride_ss, stride_on, stride_oc, stride_os,
    S: tl.constexpr, S_POW2: tl.constexpr, VARLEN: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Sequence n's new state: the last S inputs of state ++ chunk, oldest first."""
    n, cb = tl.program_id(0), tl.program_id(1)
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    s = tl.arange(0, S_POW2)
    c_ok, s_ok = c < C, s < S
    if VARLEN:
        start = tl.load(cu_ptr + n).to(tl.int64)
        length = tl.load(cu_ptr + n + 1).to(tl.int64) - start
        x_row = x_ptr
    else:
        start = 0
        length = T
        x_row = x_ptr + n.to(tl.int64) * stride_xb
    idx = length - S + s  # < 0: still from the old state
    ok = c_ok[:, None] & s_ok[None, :]
    from_x = (idx >= 0)[None, :]
    xv = tl.load(x_row + (start + idx)[None, :] * stride_xt + c[:, None] * stride_xc, mask=ok & from_x, other=0.0)
    sv = tl.load(state_ptr + n.to(tl.int64) * stride_sn + c[:, None] * stride_sc + (S + idx)[None, :] * stride_ss,
                 mask=ok & ~from_x, other=0.0)
    val = tl.where(from_x, xv.to(out_ptr.dtype.element_ty), sv.to(out_ptr.dtype.element_ty))
    tl.store(out_ptr + n.to(tl.int64) * stride_on + c[:, None] * stride_oc + s[None, :] * stride_os, val, mask=ok)


def causal_conv1d_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    cu_seqlens: torch.Tensor | None = None,
    block_t: int = 32,
    block_c: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_conv1d_reference` in two launches: x [B, C, T] (any strides; with cu_seqlens [N + 1]
    B is 1 and the N sequences are packed along T), weight [C, W] or [C, 1, W], bias [C] or None,
    conv_state [N, C, S >= W-1] (None: zeros) -> (act(conv) [B, C, T] in x.dtype, laid out like x;
    new state [N, C, S] in conv_state's dtype)."""
    b, _, t = x.shape
    varlen = cu_seqlens is not None
    if varlen and b != 1:
        raise ValueError(f"batch size must be 1 when cu_seqlens is given, got {b}")
    n = cu_seqlens.shape[0] - 1 if varlen else b
    weight, conv_state = conv1d_arguments(x, weight, conv_state, activation, n)
    c, w = weight.shape
    s = conv_state.shape[-1]
    y = torch.empty_like(x)  # x's layout: [T, C]-major when x is a transposed [T, C] projection
    new_state = torch.empty((n, c, s), dtype=conv_state.dtype, device=x.device)
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    if varlen:
        cu = cu_seqlens.to(torch.int64)
        rows = torch.arange(t, device=x.device)
        seq = torch.searchsorted(cu[1:].contiguous(), rows, right=True).to(torch.int32)  # row -> its sequence
    else:
        cu = seq = torch.zeros(1, dtype=torch.int64, device=x.device)
    if t and n:
        _conv_kernel[(triton.cdiv(t, block_t), triton.cdiv(c, block_c), b)](
            x, weight, bias if bias is not None else weight, conv_state, seq, cu, y, t, c,
            x.stride(0), x.stride(1), x.stride(2), weight.stride(0),
            conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), y.stride(0), y.stride(1), y.stride(2),
            W=w, S=s, VARLEN=varlen, HAS_BIAS=bias is not None, SILU=activation is not None,
            BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4,
        )
    if n:
        _state_kernel[(n, triton.cdiv(c, block_c))](
            x, conv_state, cu, new_state, t, c, x.stride(0), x.stride(1), x.stride(2),
            conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
            new_state.stride(0), new_state.stride(1), new_state.stride(2),
            S=s, S_POW2=max(2, triton.next_power_of_2(s)), VARLEN=varlen, BLOCK_C=block_c, num_warps=4,
        )
    return y, new_state
