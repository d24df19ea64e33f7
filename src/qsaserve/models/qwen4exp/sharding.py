"""Which part of each full checkpoint tensor this rank keeps (tensor parallel, and the query
rows of decode context parallelism). `RankLayout` derives every rule from the config and the
ParallelContext: attention, GDN and expert / shared-expert intermediate dims are split; the
indexer, the hyper-connection mixers, the norms, the router and the PLE are replicated. Column-
parallel weights keep row ranges, row-parallel ones (o_proj, out_proj, down_proj) the matching
column ranges, their outputs summed over the ranks (parallel/tp.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from qsaserve.parallel.state import ParallelContext
from qsaserve.parallel.tp import even_range, kv_head_range, kv_heads_per_rank, shard_vocab, take


@dataclass(frozen=True)
class Shard:
    """The index ranges `ranges` of dimension `dim` of a full tensor, concatenated; `ranges`
    None keeps the tensor whole (replicated)."""

    dim: int = 0
    ranges: tuple[tuple[int, int], ...] | None = None

    def __call__(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.ranges is None else take(full, self.dim, list(self.ranges))

    def of_slice(self) -> Shard:
        """The same rule on one slice along dim 0 (one expert of an [E, ...] tensor)."""
        return self if self.ranges is None else Shard(self.dim - 1, self.ranges)


REPLICATED = Shard()


@dataclass(frozen=True)
class VocabShard(Shard):
    """Rows of the embedding / LM head, padded to the same count on every rank (parallel/tp.py)."""

    vocab_size: int = 0
    tp_size: int = 1
    tp_rank: int = 0

    def __call__(self, full: torch.Tensor) -> torch.Tensor:
        return shard_vocab(full, self.vocab_size, self.tp_size, self.tp_rank)


def block_range(n: int, tp_size: int, rank: int, block: int) -> tuple[int, int]:
    """This rank's part of a dimension of n split on whole `block`s, the first (n / block) % tp_size
    ranks one block more (n 640 in blocks of 128 at TP2: 384 | 256); an even split when n is not a
    whole number of at least tp_size blocks."""
    blocks = n // block
    if block == 1 or n % block or blocks < tp_size:
        return even_range(n, tp_size, rank)
    per, extra = divmod(blocks, tp_size)
    start = rank * per + min(rank, extra)
    return start * block, (start + per + (rank < extra)) * block


class RankLayout:
    """This rank's part of every split dimension, and the Shard of each kind of weight. KV heads
    and GDN key heads are duplicated when there are fewer than ranks. block: the MoE intermediate
    dimensions (routed and shared experts) split on whole blocks of this many rows (128 with
    block-FP8 weights, so no rank cuts a weight block; 16 with NVFP4 weights, so no rank cuts a
    down_proj scale group: block_range), else evenly."""

    def __init__(self, cfg, ctx: ParallelContext, block: int = 1):
        self.config, self.ctx = cfg, ctx
        n, r = ctx.tp_size, ctx.tp_rank
        self.split = n > 1
        self.query_heads = even_range(cfg.num_attention_heads, n, r)  # this rank's own heads
        self.kv_heads = kv_head_range(cfg.num_key_value_heads, n, r)
        self.num_kv_heads = kv_heads_per_rank(cfg.num_key_value_heads, n)  # KV heads of this rank's pages
        self.gdn_key_heads = kv_head_range(cfg.linear_num_key_heads, n, r)
        self.gdn_value_heads = even_range(cfg.linear_num_value_heads, n, r)
        self.expert_inter = block_range(cfg.moe_intermediate_size, n, r, block)
        self.shared_inter = block_range(cfg.shared_expert_intermediate_size, n, r, block)

    def _rows(self, dim: int, *ranges: tuple[int, int]) -> Shard:
        return Shard(dim, tuple(ranges)) if self.split else REPLICATED

    # ---- embedding / LM head ----
    def vocab(self) -> Shard:
        c, ctx = self.config, self.ctx
        return VocabShard(vocab_size=c.vocab_size, tp_size=ctx.tp_size, tp_rank=ctx.tp_rank) if self.split else REPLICATED

    # ---- QSA attention ----
    def query_head_range(self) -> tuple[int, int]:
        """Query heads this rank projects. Under DCP every rank of a DCP group attends with all of
        the group's query heads over its own token shard of their KV head, so each rank computes
        the whole group's queries itself (the group's query rows of q_proj, query_gate_rows: a
        wider GEMM) instead of all-gathering them every layer and step; the group is D consecutive
        TP ranks. Outside DCP: this rank's heads."""
        ctx, h = self.ctx, self.config.num_attention_heads
        first = ctx.tp_rank - ctx.dcp.rank
        return even_range(h, ctx.tp_size, first)[0], even_range(h, ctx.tp_size, first + ctx.dcp.size - 1)[1]

    def query_gate_rows(self) -> list[tuple[int, int]]:
        """The rows of q_proj this rank holds. The checkpoint interleaves, per head, D query rows and
        D gate rows. Outside DCP: this rank's heads, interleaved as they are. Under DCP: the query
        rows of every head of the DCP group (each rank attends with all of them, query_head_range),
        then the gate rows of this rank's own heads only: the gate is applied after the merge, to
        the heads the merge returns, so the group's other gates would be projected for nothing."""
        d = self.config.head_dim
        ga, gb = self.query_head_range()
        if not self.ctx.dcp.enabled:
            return [(ga * 2 * d, gb * 2 * d)]
        oa, ob = self.query_heads
        queries = [(h * 2 * d, h * 2 * d + d) for h in range(ga, gb)]
        return queries + [(h * 2 * d + d, (h + 1) * 2 * d) for h in range(oa, ob)]

    def q_proj(self) -> Shard:
        return self._rows(0, *self.query_gate_rows())

    def kv_proj(self) -> Shard:
        d, (a, b) = self.config.head_dim, self.kv_heads
        return self._rows(0, (a * d, b * d))

    def o_proj(self) -> Shard:
        d, (a, b) = self.config.head_dim, self.query_heads
        return self._rows(1, (a * d, b * d))

    # ---- Gated DeltaNet ----
    def gdn_qkv_channels(self) -> Shard:
        """in_proj_qkv's rows and conv1d's channels: q | k | v, each cut to this rank's heads."""
        c = self.config
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        (ka, kb), (va, vb) = self.gdn_key_heads, self.gdn_value_heads
        key = c.linear_num_key_heads * dk
        return self._rows(0, (ka * dk, kb * dk), (key + ka * dk, key + kb * dk), (2 * key + va * dv, 2 * key + vb * dv))

    def gdn_value_rows(self) -> Shard:
        dv, (va, vb) = self.config.linear_value_head_dim, self.gdn_value_heads
        return self._rows(0, (va * dv, vb * dv))

    def gdn_per_head(self) -> Shard:
        """in_proj_b, in_proj_a, dt_bias, A_log: one row per value head."""
        return self._rows(0, self.gdn_value_heads)

    def gdn_out_proj(self) -> Shard:
        dv, (va, vb) = self.config.linear_value_head_dim, self.gdn_value_heads
        return self._rows(1, (va * dv, vb * dv))

    # ---- MoE ----
    def experts_gate_up(self) -> Shard:
        inter, (ia, ib) = self.config.moe_intermediate_size, self.expert_inter
        return self._rows(1, (ia, ib), (inter + ia, inter + ib))

    def experts_down(self) -> Shard:
        return self._rows(2, self.expert_inter)

    def expert_proj(self, proj: str) -> Shard:
        """One expert's checkpoint gate_proj / up_proj [I, H] or down_proj [H, I]."""
        return self._rows(1 if proj == "down_proj" else 0, self.expert_inter)

    def shared_gate_up(self) -> Shard:
        return self._rows(0, self.shared_inter)

    def shared_down(self) -> Shard:
        return self._rows(1, self.shared_inter)
