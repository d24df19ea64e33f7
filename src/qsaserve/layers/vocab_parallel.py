"""The vocabulary-parallel embedding and LM head: the table's rows split over the TP ranks
(parallel/tp.vocab_range), every shard padded to the same height."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qsaserve.layers.linear import linear_weight
from qsaserve.parallel.tp import vocab_range


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
