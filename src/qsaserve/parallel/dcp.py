"""Decode-context-parallel (DCP) geometry: the one place that knows where a token's K/V lives.

DCP reuses tensor-parallel ranks: ranks that would hold copies of the same KV head instead hold
interleaved token shards of it. Ranks are grouped in consecutive runs of D (those share one KV
head under TP); a rank's DCP rank is its TP rank modulo D.

With interleave size I, token t lives on DCP rank (t // I) % D at local offset
(t // (D*I)) * I + t % I. Each rank's KV pages hold B tokens (B = --block-size), and one engine
block (the block manager's unit, shared by every rank's block table) covers B*D tokens: since
I divides B, local offset // B is exactly the engine block index t // (B*D), so every rank uses
the engine's block table unchanged and only the slot inside the page is local. Index caches
(QSA) are replicated and keep engine-level slots: B*D tokens per page.

Everything else asks this module: owner and local slot of a token, per-rank lengths, the global
position of a local row, the step's write plan (host lists, or device tensors for decode steps),
KV-spec scaling and capacity.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from qsaserve.cache.kv_cache import KVCacheSpec, usable_blocks
from qsaserve.errors import InvalidRequestError


def check_dcp_config(tp_size: int, dcp_size: int, num_kv_heads: int) -> None:
    """vLLM's rule: DCP shards what TP would duplicate, so T / Hkv >= D; and a DCP group (D
    consecutive ranks) must not straddle two KV heads, so (T / Hkv) % D == 0. That D divides T and
    the interleave size divides block_size is checked with the rest of the config (config.py)."""
    if dcp_size == 1:
        return
    if tp_size < num_kv_heads * dcp_size or (tp_size // num_kv_heads) % dcp_size:
        raise InvalidRequestError(
            "decode_context_parallel_size",
            f"{dcp_size} is too large for the model's {num_kv_heads} KV heads: DCP reuses the ranks that would hold "
            f"duplicate KV heads, so tensor_parallel_size / num_kv_heads ({tp_size}/{num_kv_heads}) must be >= and a "
            f"multiple of decode_context_parallel_size")


class DcpStepPlan:
    """This rank's share of one step: which new tokens it stores, where, and per-sequence local lengths.

    Built from the runner's host lists; the write tensors are made (one H2D copy each) only when a
    path asks for them. Decode steps of the Qwen4Exp fast path use `DcpGeometry.decode_slots` and
    `local_lens` on device tensors instead, so they never trigger these copies."""

    def __init__(self, geometry: "DcpGeometry", positions: list[int], query_lens: list[int],
                 block_tables: list[list[int]], local_seq_lens: list[int], device):
        self._args = (geometry, positions, query_lens, block_tables, device)
        self.local_seq_lens = local_seq_lens  # tokens of each sequence's context held by this rank

    @functools.cached_property
    def _writes(self) -> tuple[torch.Tensor, torch.Tensor]:
        g, positions, query_lens, block_tables, device = self._args
        rows, slots = [], []
        row = 0
        for n, table in zip(query_lens, block_tables):
            for i in range(row, row + n):
                if g.owner(positions[i]) == g.rank:
                    rows.append(i)
                    slots.append(g.local_slot(positions[i], table))
            row += n
        return (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(slots, dtype=torch.long, device=device))

    @property
    def write_rows(self) -> torch.Tensor:
        """[n] int64: rows of the step's tokens this rank owns."""
        return self._writes[0]

    @property
    def write_slots(self) -> torch.Tensor:
        """[n] int64: their local KV slots."""
        return self._writes[1]


@dataclass(frozen=True)
class KVCapacity:
    """KV capacity of one configuration at a given per-rank memory budget."""

    dcp_size: int
    num_blocks: int  # usable engine blocks (the null block excluded)
    block_tokens: int  # tokens per engine block
    bytes_per_block: int  # per rank
    max_model_len: int
    blocks_per_request: int  # engine blocks of one max_model_len request

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_tokens

    @property
    def max_len_requests(self) -> float:
        return self.num_blocks / self.blocks_per_request


@dataclass(frozen=True)
class DcpGeometry:
    size: int = 1  # D
    rank: int = 0  # this rank's DCP rank
    interleave: int = 1  # I
    block_size: int = 16  # B: tokens per KV page on one rank

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"DCP rank {self.rank} outside [0, {self.size})")

    @staticmethod
    def for_tp_rank(tp_rank: int, dcp_size: int, interleave: int, block_size: int) -> "DcpGeometry":
        return DcpGeometry(dcp_size, tp_rank % dcp_size, interleave, block_size)

    @staticmethod
    def group_ranks(tp_size: int, dcp_size: int) -> list[list[int]]:
        """The DCP groups: runs of D consecutive TP ranks (they share a KV head under TP)."""
        return [list(range(g, g + dcp_size)) for g in range(0, tp_size, dcp_size)]

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def engine_block_size(self) -> int:
        """Tokens per engine block (block manager, block tables, index pages)."""
        return self.block_size * self.size

    # ---- one token ----
    def owner(self, t: int) -> int:
        return (t // self.interleave) % self.size

    def local_offset(self, t: int) -> int:
        span = self.size * self.interleave
        return (t // span) * self.interleave + t % self.interleave

    def global_position(self, j: int, rank: int | None = None) -> int:
        """Inverse of local_offset for the given rank (default: this one)."""
        rank = self.rank if rank is None else rank
        span = self.size * self.interleave
        return (j // self.interleave) * span + rank * self.interleave + j % self.interleave

    def local_slot(self, t: int, block_table: list[int]) -> int:
        off = self.local_offset(t)
        return block_table[off // self.block_size] * self.block_size + off % self.block_size

    def local_len(self, length: int, rank: int | None = None) -> int:
        """How many of tokens [0, length) the rank holds."""
        rank = self.rank if rank is None else rank
        span = self.size * self.interleave
        rem = length % span - rank * self.interleave
        return (length // span) * self.interleave + min(max(rem, 0), self.interleave)

    # ---- tensors ----
    def key_positions(self, n: int, device) -> torch.Tensor:
        """Global positions of this rank's local rows 0..n-1 (ascending)."""
        j = torch.arange(n, device=device)
        return (j // self.interleave) * (self.size * self.interleave) + self.rank * self.interleave + j % self.interleave

    def localize(self, positions: torch.Tensor) -> torch.Tensor:
        """Global token positions (-1 = none) -> this rank's local rows, -1 where another rank owns them."""
        span = self.size * self.interleave
        local = (positions // span) * self.interleave + positions % self.interleave
        mine = (positions >= 0) & ((positions // self.interleave) % self.size == self.rank)
        return torch.where(mine, local, torch.full_like(positions, -1))

    def step_plan(self, positions: list[int], query_lens: list[int], seq_lens: list[int],
                  block_tables: list[list[int]], device) -> DcpStepPlan:
        return DcpStepPlan(self, positions, query_lens, block_tables, [self.local_len(n) for n in seq_lens], device)

    # ---- device tensors (no host syncs, shapes fixed by the inputs: CUDA-graph safe) ----
    def local_lens(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """local_len of every entry of a device tensor of context lengths."""
        span = self.size * self.interleave
        rem = (seq_lens % span - self.rank * self.interleave).clamp(0, self.interleave)
        return (seq_lens // span) * self.interleave + rem

    def decode_slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Engine-level slots of new tokens ([T], -1 = padding; what the replicated index pages use)
        -> this rank's K/V slots, -1 where another rank owns the token.

        An engine block holds B*D tokens and its K/V page the B local ones (see the module
        docstring), so the engine slot alone gives the block and the position inside it."""
        span, i = self.size * self.interleave, self.interleave
        block, rem = slot_mapping // self.engine_block_size, slot_mapping % self.engine_block_size
        local = block * self.block_size + (rem // span) * i + rem % i
        mine = (slot_mapping >= 0) & ((rem // i) % self.size == self.rank)
        return torch.where(mine, local, torch.full_like(slot_mapping, -1))

    # ---- cache geometry and capacity ----
    def scale_spec(self, spec: KVCacheSpec) -> KVCacheSpec:
        """A per-rank DCP1 spec (pages of B tokens) -> the spec this rank allocates: engine blocks of
        B*D tokens whose K/V pages hold B local tokens and whose replicated index pages hold all B*D."""
        if not self.enabled:
            return spec
        return dataclasses.replace(spec, block_size=self.engine_block_size, kv_block_size=self.block_size)

    def capacity(self, spec: KVCacheSpec, budget_bytes: int, max_model_len: int) -> tuple[KVCapacity, KVCapacity]:
        """(this configuration, DCP1) at the same per-rank memory; spec is the per-rank DCP1 spec."""
        ours = self.scale_spec(spec)
        out = []
        for s, d in ((ours, self.size), (spec, 1)):
            out.append(KVCapacity(d, usable_blocks(s.num_blocks_for(budget_bytes)), s.block_size, s.bytes_per_block,
                                  max_model_len, s.blocks_for(max_model_len)))
        return out[0], out[1]
