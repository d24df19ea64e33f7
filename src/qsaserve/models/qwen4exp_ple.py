"""Qwen4Exp PLE (hashed n-gram per-layer embedding): hashing, table gather, layer math.

Matches transformers ``Qwen4ExpTextNGramEmbedding`` / ``Qwen4ExpTextPLELayer`` but continues from
explicit per-request state so arbitrary chunking gives identical results:

* n-gram context: the last ``ngram_size - 1`` token ids (a new request starts with all EOS);
* conv state: the last ``(ple_conv_kernel_size - 1) * ngram_size`` normed gated values
  ``[hc_count * hidden_size, ...]`` (the conv is dilated by ``ngram_size``).

Hashing (per PLE layer ``l`` = index of the layer in the sorted ``ple_layer_ids``):
``m[0..ngram_size-1]`` odd 64-bit multipliers from SplitMix64 (:func:`ple_layer_multipliers`);
for the n-gram order ``n`` (2..ngram_size) ending at token ``t``
``h = (x_t*m0) ^ (x_{t-1}*m1) ^ ... ^ (x_{t-n+1}*m_{n-1})`` (exact int64: each product is
``< 2**63``), then for each of the ``heads_per_ngram`` heads ``row = h % prime + offset``.
Head order: all heads of 2-grams, then 3-grams, ... Primes are consecutive primes
``>= ngram_vocab_size_base``, numbered globally over (PLE layer, head); offsets are running sums
inside a layer's table. ``x_{t-s}`` is replaced by EOS when the segment of ``t`` (which starts
right after the last EOS strictly before ``t``) does not reach back to ``t-s``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qsaserve.models.qwen4exp_blocks import rms_norm

__all__ = [
    "SPLITMIX64_GAMMA",
    "SPLITMIX64_MUL1",
    "SPLITMIX64_MUL2",
    "PLE_LAYER_SEED_STRIDE",
    "splitmix64",
    "ple_layer_multipliers",
    "ple_head_vocab_sizes",
    "PLEHashParams",
    "ple_initial_context",
    "ple_ngram_ids",
    "TableLookup",
    "TensorRowTable",
    "ple_embed",
    "ple_short_conv",
    "ple_layer_forward",
]

_MASK64 = (1 << 64) - 1
SPLITMIX64_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX64_MUL1 = 0xBF58476D1CE4E5B9
SPLITMIX64_MUL2 = 0x94D049BB133111EB
PLE_LAYER_SEED_STRIDE = 10007  # seed of PLE layer l is config.seed + 10007 * l

# Any callable mapping int64 row ids [...] to embedding rows [..., dim]; lets the (huge) table
# live on disk, in pinned host memory or on the GPU.
TableLookup = Callable[[torch.Tensor], torch.Tensor]


def splitmix64(x: int) -> int:
    """One SplitMix64 output for state ``x`` (the state is advanced by the gamma first)."""
    z = (x + SPLITMIX64_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * SPLITMIX64_MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * SPLITMIX64_MUL2) & _MASK64
    return z ^ (z >> 31)


def ple_layer_multipliers(vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int) -> torch.Tensor:
    """Odd multipliers ``[ngram_size]`` bounded so ``token * m`` never overflows int64."""
    bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + PLE_LAYER_SEED_STRIDE * ple_layer_index
    return torch.tensor(
        [2 * (splitmix64((base + SPLITMIX64_GAMMA * (i + 1)) & _MASK64) % bound) + 1 for i in range(ngram_size)],
        dtype=torch.long,
    )


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def ple_head_vocab_sizes(
    ngram_vocab_size_base: int, ngram_heads: int, ple_layer_index: int, divisible_by: int = 128
) -> tuple[list[int], list[int], int]:
    """``(prime per head, row offset per head, padded table rows)`` of one PLE layer.

    Global head ``g = ple_layer_index * ngram_heads + h`` uses the ``(g+1)``-th prime
    ``>= ngram_vocab_size_base``; the table has ``ceil(sum(primes) / divisible_by) * divisible_by`` rows.
    """
    primes: list[int] = []
    n = ngram_vocab_size_base - 1
    while len(primes) < (ple_layer_index + 1) * ngram_heads:
        n += 1
        if _is_prime(n):
            primes.append(n)
    sizes = primes[ple_layer_index * ngram_heads :]
    offsets = [sum(sizes[:h]) for h in range(ngram_heads)]
    return sizes, offsets, math.ceil(sum(sizes) / divisible_by) * divisible_by


@dataclass(frozen=True)
class PLEHashParams:
    """Hash constants of one PLE layer."""

    multipliers: torch.Tensor  # [ngram_size] int64
    head_vocab_sizes: torch.Tensor  # [ngram_heads] int64 (primes)
    head_offsets: torch.Tensor  # [ngram_heads] int64
    table_rows: int  # padded rows of ple.ple_embedding.ngram_embedding.weight
    ngram_size: int
    heads_per_ngram: int
    eos_token_id: int

    @property
    def context_len(self) -> int:
        return self.ngram_size - 1

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @classmethod
    def from_config(cls, cfg, layer_idx: int) -> PLEHashParams:
        """Constants for decoder layer ``layer_idx`` (0-based) of a Qwen4Exp text config."""
        ple_ids = sorted(set(cfg.ple_layer_ids))
        if layer_idx + 1 not in ple_ids:
            raise ValueError(f"layer {layer_idx} has no PLE (ple_layer_ids={ple_ids} are 1-based)")
        ple_index = ple_ids.index(layer_idx + 1)
        heads = (cfg.ngram_size - 1) * cfg.heads_per_ngram
        sizes, offsets, rows = ple_head_vocab_sizes(
            cfg.ngram_vocab_size_base, heads, ple_index, cfg.make_ngram_vocab_size_divisible_by
        )
        eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, (list, tuple)) else cfg.eos_token_id
        return cls(
            multipliers=ple_layer_multipliers(cfg.vocab_size, cfg.ngram_size, ple_index, cfg.seed),
            head_vocab_sizes=torch.tensor(sizes, dtype=torch.long),
            head_offsets=torch.tensor(offsets, dtype=torch.long),
            table_rows=rows,
            ngram_size=cfg.ngram_size,
            heads_per_ngram=cfg.heads_per_ngram,
            eos_token_id=int(eos),
        )


def ple_initial_context(params: PLEHashParams, batch: int | None = None, device=None) -> torch.Tensor:
    """Context of a fresh request: ``ngram_size - 1`` EOS ids (``[n-1]`` or ``[batch, n-1]``)."""
    shape = (params.context_len,) if batch is None else (batch, params.context_len)
    return torch.full(shape, params.eos_token_id, dtype=torch.long, device=device)


def ple_ngram_ids(
    token_ids: torch.Tensor, context_tokens: torch.Tensor, params: PLEHashParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Table rows for a chunk of tokens continuing from ``context_tokens``.

    ``token_ids`` ``[T]`` or ``[B, T]``; ``context_tokens`` ``[n-1]`` / ``[B, n-1]`` (the previous
    ``n-1`` ids of the request, EOS-filled at start). Returns ``rows`` ``[..., T, ngram_heads]``
    int64 and the new context (last ``n-1`` ids of context ++ chunk).
    """
    squeeze = token_ids.dim() == 1
    tok = token_ids.long().reshape(1, -1) if squeeze else token_ids.long()
    ctx = context_tokens.long().reshape(1, -1) if squeeze else context_tokens.long()
    n, c = params.ngram_size, params.context_len
    if ctx.shape != (tok.shape[0], c):
        raise ValueError(f"context must hold {c} ids per row, got {tuple(context_tokens.shape)}")
    hist = torch.cat([ctx.to(tok.device), tok], dim=1)  # [B, c + T]
    T = tok.shape[1]
    eos = params.eos_token_id
    # eos_before[j] = number of EOS in hist[:j]
    eos_before = F.pad((hist == eos).long().cumsum(dim=1), (1, 0))
    pos = torch.arange(c, c + T, device=tok.device)  # history index of each output token
    mult = params.multipliers.to(tok.device)
    shifted = [hist[:, pos]]
    for s in range(1, n):
        # x_{t-s} survives iff no EOS lies strictly between t-s and t (an EOS at t-s is EOS anyway).
        eos_between = eos_before[:, pos] - eos_before[:, pos - s + 1]
        shifted.append(torch.where(eos_between == 0, hist[:, pos - s], torch.full_like(tok, eos)))
    blocks = []
    sizes = params.head_vocab_sizes.to(tok.device)
    offsets = params.head_offsets.to(tok.device)
    h = shifted[0] * mult[0]
    for order in range(2, n + 1):
        h = torch.bitwise_xor(h, shifted[order - 1] * mult[order - 1])
        sl = slice((order - 2) * params.heads_per_ngram, (order - 1) * params.heads_per_ngram)
        blocks.append(torch.remainder(h[..., None], sizes[sl]) + offsets[sl])
    rows = torch.cat(blocks, dim=-1)
    new_ctx = hist[:, -c:] if c > 0 else hist[:, :0]
    if squeeze:
        return rows[0], new_ctx[0]
    return rows, new_ctx


class TensorRowTable:
    """``table_lookup`` over an in-memory weight ``[rows, dim]`` (any device; results follow ``rows``)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        flat = rows.reshape(-1).to(self.weight.device)
        return self.weight.index_select(0, flat).reshape(*rows.shape, -1).to(rows.device)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    return gated + conv, new_ctx, new_state
