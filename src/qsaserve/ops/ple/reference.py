"""Torch references of a Qwen4Exp PLE (hashed n-gram per-layer embedding) layer: the table
gather and layer math of transformers ``Qwen4ExpTextPLELayer`` (`ple_layer_forward`, the model's
path outside the fused decode step), continuing from explicit per-request state so arbitrary
chunking gives identical results, and the decode-step kernels' references (triton_ple.py) in their
decode-shaped signatures, built from that code on [B, 1] chunks. Hashing is in hashing.py.

State: the n-gram context (hashing.py) and the conv state, the last
``(ple_conv_kernel_size - 1) * ngram_size`` normed gated values ``[hc_count * hidden_size, ...]``
(the conv is dilated by ``ngram_size``). The grouped norms go through `ops.fused.one_centred_rms_norm`
(its Triton kernel on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from qsaserve.ops.fused import one_centred_rms_norm as rms_norm
from qsaserve.ops.ple.hashing import PLEHashParams, ple_initial_context, ple_ngram_ids
from qsaserve.ops.ple.row_shards import RowShards

__all__ = [
    "TableLookup",
    "TensorRowTable",
    "ple_embed",
    "ple_short_conv",
    "ple_layer_forward",
    "ngram_rows_decode_reference_",
    "stream_gate_reference",
    "dilated_conv_decode_reference_",
    "gather_rows_reference_",
]

# Any callable mapping int64 row ids [...] to embedding rows [..., dim]; lets the (huge) table
# live on disk, in pinned host memory or on the GPU.
TableLookup = Callable[[torch.Tensor], torch.Tensor]


class TensorRowTable:
    """``table_lookup`` over an in-memory weight ``[rows, dim]`` (any device; results follow ``rows``)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        flat = rows.reshape(-1).to(self.weight.device)
        return self.weight.index_select(0, flat).reshape(*rows.shape, -1).to(rows.device)


def gather_rows_reference_(out: torch.Tensor, table: RowShards, rows: torch.Tensor) -> torch.Tensor:
    """triton_gather.gather_rows_: out[i] = table row rows[i], gathered where the shards live (a
    host table: on the host), one index_select per shard the rows touch."""
    flat = rows.to(table.shards[0].device)
    starts = torch.tensor(table.starts_host, dtype=torch.int64, device=flat.device)
    shard_of = torch.searchsorted(starts, flat, right=True) - 1
    for s in torch.unique(shard_of).tolist():
        pick = (shard_of == s).nonzero().flatten()
        values = table.shards[s].index_select(0, flat.index_select(0, pick) - table.starts_host[s])
        out.index_copy_(0, pick.to(out.device), values.to(device=out.device, dtype=out.dtype))
    return out


def ple_embed(rows: torch.Tensor, table_lookup: TableLookup) -> torch.Tensor:
    """Concatenated head embeddings ``[..., T, ngram_heads * head_dim]`` for rows ``[..., T, heads]``."""
    return table_lookup(rows).flatten(-2)


def ple_short_conv(
    x: torch.Tensor, weight: torch.Tensor, dilation: int, conv_state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``silu`` of the dilated depthwise causal conv (no bias) over a chunk, with state.

    ``x`` ``[B, T, C]``; ``weight`` ``[C, 1, K]`` / ``[C, K]``; ``conv_state`` ``[B, C, (K-1)*dilation]``
    previous inputs, oldest first (``None`` = zeros). ``y[t] = sum_j w[j] * x[t - (K-1-j)*dilation]``.
    Returns ``(y [B, T, C], new_state)``; computed in fp32, cast to ``x.dtype``.
    """
    w = weight if weight.dim() == 3 else weight[:, None, :]
    C, K = w.shape[0], w.shape[-1]
    span = (K - 1) * dilation
    if conv_state is None:
        conv_state = x.new_zeros(x.shape[0], C, span)
    if conv_state.shape != (x.shape[0], C, span):
        raise ValueError(f"conv_state must be {(x.shape[0], C, span)}, got {tuple(conv_state.shape)}")
    ext = torch.cat([conv_state.float(), x.transpose(1, 2).float()], dim=-1)
    y = F.silu(F.conv1d(ext, w.float(), groups=C, dilation=dilation))
    return y.transpose(1, 2).to(x.dtype), ext[..., ext.shape[-1] - span :].to(conv_state.dtype)


def ple_layer_forward(
    hyper: torch.Tensor,
    token_ids: torch.Tensor,
    p: Mapping[str, torch.Tensor],
    hash_params: PLEHashParams,
    table_lookup: TableLookup,
    hc_count: int,
    eps: float,
    context_tokens: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    state_offsets: list[int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """``Qwen4ExpTextPLELayer`` on a chunk; the caller adds the result to the residual.

    ``hyper`` ``[B, T, hc*H]`` residual streams entering the layer; ``token_ids`` ``[B, T]``;
    ``p`` keys relative to ``layers.{i}.ple.`` (``key_proj.weight``, ``value_proj.weight``,
    ``norm_key.weight``, ``norm_query.weight``, ``norm_conv.weight``, ``conv1d.weight``; the table
    is reached only through ``table_lookup``). Returns ``(delta [B, T, hc*H], new_context,
    new_conv_state)``::

        e     = concat_heads(table[rows])                                # [B, T, E]
        key   = grouped_rms(key_proj e)        value = value_proj e     # [.., hc, H], [.., H]
        qry   = grouped_rms(hyper)
        gate  = <key_s, qry_s> / sqrt(H);  gate = sign(gate) * sqrt(max(|gate|, 1e-6))
        gv    = sigmoid(gate_s) * value                                  # [.., hc, H]
        delta = gv + silu(dilated_conv(grouped_rms(gv)))                 # dilation = ngram_size

    ``state_offsets`` (chunk offsets, e.g. the prefix cache's block boundaries): two more results,
    the context ``[len, B, n-1]`` and conv state ``[len, B, hc*H, span]`` after each offset's first
    tokens.
    """
    B, T, HC = hyper.shape
    H = HC // hc_count
    if context_tokens is None:
        context_tokens = ple_initial_context(hash_params, B, hyper.device)
    rows, new_ctx = ple_ngram_ids(token_ids, context_tokens, hash_params)
    emb = ple_embed(rows, table_lookup).to(hyper.dtype)
    key = rms_norm(F.linear(emb, p["key_proj.weight"]), p["norm_key.weight"], eps, H).unflatten(-1, (hc_count, H))
    value = F.linear(emb, p["value_proj.weight"])
    query = rms_norm(hyper, p["norm_query.weight"], eps, H).unflatten(-1, (hc_count, H))
    gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(H)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
    normed = rms_norm(gated, p["norm_conv.weight"], eps, H)
    conv, new_state = ple_short_conv(normed, p["conv1d.weight"], hash_params.ngram_size, conv_state)
    if state_offsets is None:
        return gated + conv, new_ctx, new_state
    # The state after the chunk's first o tokens: the last n-1 ids and the last conv-span normed
    # values of (state ++ chunk) up to o.
    ctx_ext = torch.cat([context_tokens, token_ids], dim=-1)
    span = new_state.shape[-1]
    conv_ext = torch.cat([new_state.new_zeros(B, HC, span) if conv_state is None else conv_state,
                          normed.transpose(1, 2).to(new_state.dtype)], dim=-1)
    ctx_at = torch.stack([ctx_ext[..., o : o + new_ctx.shape[-1]] for o in state_offsets])
    conv_at = torch.stack([conv_ext[..., o : o + span] for o in state_offsets])
    return gated + conv, new_ctx, new_state, ctx_at, conv_at


def ngram_rows_decode_reference_(tokens, contexts, slots, fresh, params) -> torch.Tensor:
    start = torch.where(fresh[:, None], ple_initial_context(params, tokens.shape[0], tokens.device), contexts[slots])
    rows, new = ple_ngram_ids(tokens[:, None], start, params)
    contexts[slots] = new
    return rows[:, 0]


def stream_gate_reference(key, query, value, hc: int) -> torch.Tensor:
    h = key.shape[-1] // hc
    gate = (key.unflatten(-1, (hc, h)) * query.unflatten(-1, (hc, h))).sum(dim=-1, keepdim=True) / math.sqrt(h)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    return (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)


def dilated_conv_decode_reference_(x, residual, weight, states, slots, fresh, dilation: int) -> torch.Tensor:
    start = torch.where(fresh[:, None, None], 0, states[slots])
    y, new_state = ple_short_conv(x[:, None], weight, dilation, start)
    states[slots] = new_state
    return residual + y[:, 0]
