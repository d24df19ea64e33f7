"""Tensor-parallel sharding: which slice of a checkpoint tensor a rank keeps.

Column-parallel weights (q/k/v, gate/up) keep a row range; row-parallel ones (o_proj, down_proj)
keep the matching column range and their outputs are summed over ranks. KV heads are split when
there are at least as many as ranks, else each rank keeps one head (ranks r*Hkv//T share head
r // (T/Hkv)); DCP turns those duplicates into token shards (parallel/dcp.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qsaserve.layers.linear import linear_weight


def even_range(n: int, tp_size: int, rank: int) -> tuple[int, int]:
    per = n // tp_size
    return rank * per, (rank + 1) * per


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: its share, or one (duplicated) head when T > Hkv."""
    return -(-num_kv_heads // tp_size)


def kv_head_range(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    if tp_size <= num_kv_heads:
        return even_range(num_kv_heads, tp_size, rank)
    head = rank // (tp_size // num_kv_heads)
    return head, head + 1


def vocab_range(vocab_size: int, tp_size: int, rank: int) -> tuple[int, int]:
    """Rows [start, end) of the embedding / LM head on this rank; every shard is padded to
    ceil(V / T) rows so the gathered logits have a fixed width."""
    per = -(-vocab_size // tp_size)
    return min(rank * per, vocab_size), min((rank + 1) * per, vocab_size)


def vocab_shard_rows(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size)


def take(t: torch.Tensor, dim: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Concatenation of the given index ranges of t along dim."""
    parts = [t.narrow(dim, a, b - a) for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def shard_vocab(t: torch.Tensor, vocab_size: int, tp_size: int, rank: int) -> torch.Tensor:
    a, b = vocab_range(vocab_size, tp_size, rank)
    rows = t[a:b]
    pad = vocab_shard_rows(vocab_size, tp_size) - (b - a)
    return F.pad(rows, (0, 0, 0, pad)) if pad else rows


def vocab_parallel_embedding(weight: torch.Tensor, ids: torch.Tensor, vocab_size: int, ctx) -> torch.Tensor:
    """Embedding lookup with the table split by rows over the TP ranks: each rank looks up the ids
    it holds (zeros elsewhere) and the all-reduce assembles the rows."""
    if ctx.tp_size == 1:
        return F.embedding(ids, weight)
    start, end = vocab_range(vocab_size, ctx.tp_size, ctx.tp_rank)
    mine = (ids >= start) & (ids < end)
    out = F.embedding(torch.where(mine, ids - start, torch.zeros_like(ids)), weight)
    out = out * mine[:, None].to(out.dtype)
    return ctx.all_reduce(out)


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, ctx) -> torch.Tensor:
    """LM head with vocab-split rows: local logits, gathered over ranks, padding cut."""
    logits = linear_weight(hidden, weight).float()
    return ctx.all_gather_last(logits)[..., :vocab_size]
