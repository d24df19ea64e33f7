"""A PLE layer's decode step (one token per sequence) in Triton, around its projections, the table
gather and the grouped norms. References: reference.py (`hashing.ple_ngram_ids`, the gate lines
of ple_layer_forward, ple_short_conv), on the same [B, 1] chunks the model feeds them.

* ngram_rows_decode_: the token's hashed table rows from its slot's last n-1 ids (EOS-filled when
  fresh; an EOS cuts the n-gram), the slot's context advanced in place -> rows [B, heads] int64.
* stream_gate: gate_s = <key_s, query_s> / sqrt(H), sign(gate) sqrt(max(|gate|, 1e-6)),
  gated_s = sigmoid(gate_s) * value, for each of the hc streams.
* dilated_conv_decode_: silu of the dilated depthwise causal conv over the slot's state ++ x, the
  state advanced in place; returns residual + conv (the layer's delta).
Each intermediate is rounded to the model dtype where the torch code rounds it.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from qsaserve.ops.gdn.triton_decode import causal_conv_step


@triton.jit
def _ngram_rows_kernel(tok_ptr, ctx_ptr, slots_ptr, fresh_ptr, mult_ptr, sizes_ptr, offsets_ptr, rows_ptr,
                       eos, stride_ctx, stride_rows, N: tl.constexpr, HPN: tl.constexpr, HPN_POW2: tl.constexpr,
                       C_POW2: tl.constexpr):
    b = tl.program_id(0)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    fresh = tl.load(fresh_ptr + b) != 0
    tok = tl.load(tok_ptr + b).to(tl.int64)
    ctx_row = ctx_ptr + slot * stride_ctx
    j = tl.arange(0, HPN_POW2)
    j_ok = j < HPN
    h = tok * tl.load(mult_ptr)
    seen_eos = fresh != fresh  # False; an EOS strictly between x_{t-s} and t replaces x_{t-s} by EOS
    for s in tl.static_range(1, N):
        cand = tl.where(fresh, eos, tl.load(ctx_ptr + slot * stride_ctx + (N - 1 - s)).to(tl.int64))
        shifted = tl.where(seen_eos, eos, cand)
        seen_eos = seen_eos | (cand == eos)
        h = h ^ (shifted * tl.load(mult_ptr + s))
        # heads of the (s+1)-gram: remainder (non-negative, like torch.remainder) + offset
        sizes = tl.load(sizes_ptr + (s - 1) * HPN + j, mask=j_ok, other=1)
        r = h % sizes
        r = tl.where(r < 0, r + sizes, r)
        offs = tl.load(offsets_ptr + (s - 1) * HPN + j, mask=j_ok, other=0)
        tl.store(rows_ptr + b.to(tl.int64) * stride_rows + (s - 1) * HPN + j, r + offs, mask=j_ok)
    # New context: the last n-1 ids of (context ++ token): entry i takes old entry i + 1, the last
    # one the token. Every old entry is read before any is written.
    i = tl.arange(0, C_POW2)
    old = tl.load(ctx_row + i + 1, mask=(i + 1 < N - 1) & (fresh == 0), other=eos).to(tl.int64)
    new = tl.where(i == N - 2, tok, old)
    tl.debug_barrier()
    tl.store(ctx_row + i, new.to(ctx_ptr.dtype.element_ty), mask=i < N - 1)


@triton.jit
def _stream_gate_kernel(key_ptr, query_ptr, value_ptr, out_ptr, H, inv_sqrt_h, stride_k, stride_q, stride_v, stride_o,
                        BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    c = tl.arange(0, BLOCK)
    ok = c < H
    k = tl.load(key_ptr + b * stride_k + s * H + c, mask=ok, other=0.0)
    dt = k.dtype
    q = tl.load(query_ptr + b * stride_q + s * H + c, mask=ok, other=0.0)
    prod = (k.to(tl.float32) * q.to(tl.float32)).to(dt).to(tl.float32)
    # sum, then / sqrt(H): torch on CUDA multiplies by the scalar's reciprocal
    g = (tl.sum(prod, 0).to(dt).to(tl.float32) * inv_sqrt_h).to(dt).to(tl.float32)
    mag = tl.sqrt_rn(tl.maximum(tl.abs(g), 1e-6).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    sign = tl.where(g > 0, 1.0, tl.where(g < 0, -1.0, 0.0))
    g = (mag * sign).to(dt).to(tl.float32)
    sig = tl.sigmoid(g).to(dt).to(tl.float32)
    v = tl.load(value_ptr + b * stride_v + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * stride_o + s * H + c, (sig * v).to(dt), mask=ok)


@triton.jit
def _dilated_conv_kernel(x_ptr, res_ptr, w_ptr, states_ptr, slots_ptr, fresh_ptr, out_ptr, C,
                         stride_x, stride_r, stride_w, stride_sn, stride_sc, stride_o,
                         K: tl.constexpr, DIL: tl.constexpr, SPAN_POW2: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    slot = tl.load(slots_ptr + row).to(tl.int64)
    keep = tl.load(fresh_ptr + row) == 0
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + c, mask=c_ok, other=0.0)
    y = causal_conv_step(x, w_ptr, stride_w, states_ptr, slot, keep, c, c_ok, stride_sn, stride_sc, K, DIL, SPAN_POW2)
    y = y * tl.sigmoid(y)
    dt = x.dtype
    res = tl.load(res_ptr + row.to(tl.int64) * stride_r + c, mask=c_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + c, (res + y.to(dt).to(tl.float32)).to(dt), mask=c_ok)


def ngram_rows_decode_(tokens: torch.Tensor, contexts: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                       params) -> torch.Tensor:
    """tokens [B]; contexts [num_slots, n-1] (in place); slots [B]; fresh [B] bool -> rows [B, heads]."""
    b = tokens.shape[0]
    n, hpn = params.ngram_size, params.heads_per_ngram
    if n < 2 or contexts.shape[1] != n - 1 or contexts.stride(-1) != 1:
        raise ValueError("ngram_rows_decode_: contexts [slots, ngram_size - 1] with a unit last stride")
    tokens, slots, fresh = tokens.contiguous(), slots.contiguous(), fresh.contiguous()
    dev = tokens.device
    rows = torch.empty((b, (n - 1) * hpn), dtype=torch.int64, device=dev)
    if b:
        _ngram_rows_kernel[(b,)](tokens, contexts, slots, fresh, params.multipliers.to(dev),
                                 params.head_vocab_sizes.to(dev), params.head_offsets.to(dev), rows,
                                 params.eos_token_id, contexts.stride(0), rows.stride(0),
                                 N=n, HPN=hpn, HPN_POW2=triton.next_power_of_2(hpn),
                                 C_POW2=triton.next_power_of_2(n - 1), num_warps=1)
    return rows


def stream_gate(key: torch.Tensor, query: torch.Tensor, value: torch.Tensor, hc: int) -> torch.Tensor:
    """key, query [B, hc*H], value [B, H] -> sigmoid(gate_s) * value per stream, [B, hc*H]."""
    b, width = key.shape
    h = width // hc
    if key.stride(-1) != 1 or query.stride(-1) != 1 or value.stride(-1) != 1:
        key, query, value = key.contiguous(), query.contiguous(), value.contiguous()
    out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if b:
        _stream_gate_kernel[(b, hc)](key, query, value, out, h, 1.0 / math.sqrt(h), key.stride(0), query.stride(0),
                                     value.stride(0), out.stride(0), BLOCK=triton.next_power_of_2(h),
                                     num_warps=4 if h >= 1024 else 2)
    return out


def dilated_conv_decode_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, states: torch.Tensor,
                         slots: torch.Tensor, fresh: torch.Tensor, dilation: int) -> torch.Tensor:
    """x, residual [B, C]; weight [C, 1, K] or [C, K]; states [num_slots, C, (K-1)*dilation] (in
    place) -> residual + silu(conv) [B, C]."""
    b, c = x.shape
    w = weight.reshape(weight.shape[0], -1)
    k = w.shape[1]
    span = (k - 1) * dilation
    if states.shape[1:] != (c, span) or states.stride(-1) != 1 or w.stride(-1) != 1 or w.shape[0] != c:
        raise ValueError("dilated_conv_decode_: states [slots, C, (K-1)*dilation] and weight [C, K], unit last strides")
    x, residual, slots, fresh = x.contiguous(), residual.contiguous(), slots.contiguous(), fresh.contiguous()
    out = torch.empty_like(x)
    if b:
        block_c = 64
        _dilated_conv_kernel[(b, triton.cdiv(c, block_c))](
            x, residual, w, states, slots, fresh, out, c, x.stride(0), residual.stride(0), w.stride(0),
            states.stride(0), states.stride(1), out.stride(0),
            K=k, DIL=dilation, SPAN_POW2=triton.next_power_of_2(span), BLOCK_C=block_c, num_warps=4)
    return out
