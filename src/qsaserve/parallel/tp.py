"""Tensor-parallel sharding: which slice of a checkpoint tensor a rank keeps, and the startup check
that a model's dimensions split over the requested ranks.

Column-parallel weights (q/k/v, gate/up) keep a row range; row-parallel ones (o_proj, down_proj)
keep the matching column range and their outputs are summed over ranks. KV heads are split when
there are at least as many as ranks, else each rank keeps one head (ranks r*Hkv//T share head
r // (T/Hkv)); DCP turns those duplicates into token shards (parallel/dcp.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from qsaserve.errors import InvalidRequestError
from qsaserve.layers.linear import linear_weight
from qsaserve.parallel.dcp import check_dcp_config


def even_range(n: int, tp_size: int, rank: int) -> tuple[int, int]:
    per = n // tp_size
    return rank * per, (rank + 1) * per


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


def check_model_parallel(hf_config: dict, tp_size: int, dcp_size: int) -> None:
    """Refuse, naming the parameter, a TP/DCP layout the model's dimensions cannot split into."""
    if tp_size == 1 and dcp_size == 1:
        return
    from qsaserve.models.registry import is_hybrid

    if is_hybrid(hf_config):
        from qsaserve.models.qwen4exp import parse_config

        c = parse_config(hf_config)
        split = {"num_attention_heads": c.num_attention_heads, "linear_num_value_heads": c.linear_num_value_heads,
                 "moe_intermediate_size": c.moe_intermediate_size,
                 "shared_expert_intermediate_size": c.shared_expert_intermediate_size}
        heads = {"num_key_value_heads": c.num_key_value_heads, "linear_num_key_heads": c.linear_num_key_heads}
        num_kv_heads = c.num_key_value_heads
    else:
        from qsaserve.models.llama import LlamaConfig

        c = LlamaConfig.from_hf(hf_config)
        split = {"num_attention_heads": c.num_attention_heads, "intermediate_size": c.intermediate_size}
        heads = {"num_key_value_heads": c.num_key_value_heads}
        num_kv_heads = c.num_key_value_heads
    for name, n in split.items():
        if n % tp_size:
            raise InvalidRequestError("tensor_parallel_size", f"{tp_size} does not divide the model's {name} ({n})")
    for name, n in heads.items():
        if n % tp_size and tp_size % n:
            raise InvalidRequestError(
                "tensor_parallel_size", f"{tp_size} must divide or be a multiple of the model's {name} ({n})")
    check_dcp_config(tp_size, dcp_size, num_kv_heads)
