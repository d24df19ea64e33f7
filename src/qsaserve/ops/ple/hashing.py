"""Qwen4Exp PLE hashing: the n-gram table rows of each token (transformers
``Qwen4ExpTextNGramEmbedding``), continuing from an explicit per-request context (the last
``ngram_size - 1`` token ids; a new request starts with all EOS) so that any chunking hashes alike.

Per PLE layer ``l`` (index of the layer in the sorted ``ple_layer_ids``):
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
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
]

_MASK64 = (1 << 64) - 1
SPLITMIX64_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX64_MUL1 = 0xBF58476D1CE4E5B9
SPLITMIX64_MUL2 = 0x94D049BB133111EB
PLE_LAYER_SEED_STRIDE = 10007  # seed of PLE layer l is config.seed + 10007 * l

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
