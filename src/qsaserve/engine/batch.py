"""The narrow interface between the engine and the model runner: one step's inputs (plain lists
and one numpy array, picklable, so the same object can be broadcast to worker ranks) plus the
plan that says which logits rows belong to whom."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from qsaserve.engine.block_manager import BlockTables, StateSnapshotPlan
from qsaserve.engine.host_kv_tier import HostTransferPlan
from qsaserve.engine.sampler import to_device
from qsaserve.engine.scheduler import ScheduledChunk
from qsaserve.engine.sequence import Sequence


@dataclass
class BatchInput:
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    seq_lens: list[int]  # context length of each sequence after this step
    # [B, width] int32: each sequence's block ids, null-block (0) padded to the longest table. A list
    # of per-sequence lists is accepted and padded into that array.
    block_tables: np.ndarray
    logits_indices: list[int]  # token rows whose logits the runner returns, in this order
    state_slots: list[int]  # recurrent-state slot per sequence (hybrid models); a sequence whose
    # chunk starts at position 0 begins from a fresh state
    state_snapshots: StateSnapshotPlan | None = None  # the hybrid prefix cache's copies this step
    host_transfers: HostTransferPlan | None = None  # the host KV tier's copies, before everything else
    # n when every sequence verifies n - 1 drafts (its last token and the drafts, logits of every
    # row): a verify step, which a verify CUDA graph may serve (engine/cuda_graph.py); else 0.
    verify_rows: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.block_tables, np.ndarray):
            self.block_tables = pad_tables(self.block_tables)


# The input id of a row whose token is still being sampled on the device (async scheduling); the
# runner overwrites it from a TokenFeed before the forward. Never a real token id.
PLACEHOLDER_TOKEN = -1


@dataclass
class TokenFeed:
    """Input ids that are still on the device (async scheduling): token row dst[i] of the batch
    takes tokens[src[i]], the previous step's sample of the same sequence; the batch's own
    input_ids hold PLACEHOLDER_TOKEN there."""

    tokens: torch.Tensor
    dst: list[int]
    src: list[int]

    def merged(self, other: "TokenFeed") -> "TokenFeed":
        """Both feeds' rows from one source (their rows are disjoint)."""
        tokens = torch.cat([self.tokens.reshape(-1), other.tokens.reshape(-1).to(self.tokens.dtype)])
        n = self.tokens.numel()
        return TokenFeed(tokens, self.dst + other.dst, self.src + [n + s for s in other.src])

    def apply(self, input_ids: torch.Tensor) -> None:
        """Writes the fed tokens into a device input-id buffer (in stream order)."""
        n = len(self.dst)
        if self.dst == self.src == list(range(n)):  # steady decoding: the same rows in the same order
            input_ids[:n].copy_(self.tokens[:n])
            return
        dev = input_ids.device
        input_ids.index_copy_(0, to_device(self.dst, torch.long, dev),
                              self.tokens.index_select(0, to_device(self.src, torch.long, dev)))


class FedByRank0:
    """A worker rank's TokenFeed under tensor parallelism: rank 0 holds the sampled tokens and
    applies the real feed; the runner then broadcasts the input ids from rank 0 (FeedAcrossRanks)."""

    def apply(self, input_ids: torch.Tensor) -> None:
        pass


class FeedAcrossRanks:
    """A feed (rank 0's TokenFeed or a worker's FedByRank0) followed by the broadcast of the whole
    input-id buffer from rank 0, so every rank embeds the same tokens."""

    def __init__(self, feed, parallel):
        self.feed, self.parallel = feed, parallel

    def apply(self, input_ids: torch.Tensor) -> None:
        self.feed.apply(input_ids)
        self.parallel.broadcast_from_first(input_ids)


def pad_tables(tables: list[list[int]]) -> np.ndarray:
    """Ragged per-sequence block tables as one null-block-padded [B, width] int32 array."""
    width = max((len(t) for t in tables), default=0)
    out = np.zeros((len(tables), width), dtype=np.int32)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return out


@dataclass
class LogitsPlan:
    """What each returned logits row is for."""

    sample_seqs: list[Sequence] = field(default_factory=list)  # rows 0..len-1: one per sampled sequence
    # (sequence, first prompt position whose next-token logprob these rows give, number of rows)
    prompt_logprob_spans: list[tuple[Sequence, int, int]] = field(default_factory=list)
    # Speculative decoding: (index in sample_seqs, its drafts); the sequence's sample row predicts the
    # first draft's position, the drafts' own rows (one per draft, sequence after sequence) follow
    # the prompt-logprob rows.
    verify: list[tuple[int, list[int]]] = field(default_factory=list)


def build_batch(chunks: list[ScheduledChunk], tables: BlockTables, block_size: int,
                all_decode: bool = False) -> tuple[BatchInput, LogitsPlan]:
    """The block tables are one gather from the block manager's persistent array and the KV slots
    of all tokens one vectorized lookup. all_decode (SchedulerOutput.all_decode): every chunk is
    one new token after a computed prompt, built column by column without per-row branching."""
    if all_decode:
        seqs = [c.seq for c in chunks]
        if not any(s.wants_prompt_logprobs for s in seqs):
            return _build_decode(seqs, tables, block_size)
    return _build_general(chunks, tables, block_size)


def _build_decode(seqs: list[Sequence], tables: BlockTables, block_size: int) -> tuple[BatchInput, LogitsPlan]:
    """Decode rows: each sequence computes its last token, at position num_computed_tokens, and
    samples from that row."""
    b = len(seqs)
    positions = [s.num_computed_tokens for s in seqs]
    block_tables = tables.gather([s.table_row for s in seqs], max(len(s.block_table) for s in seqs))
    batch = BatchInput(
        input_ids=[s.token_ids[-1] for s in seqs],
        positions=positions,
        slot_mapping=kv_slots(block_tables, [1] * b, positions, block_size),
        query_lens=[1] * b,
        seq_lens=[p + 1 for p in positions],
        block_tables=block_tables,
        logits_indices=list(range(b)),
        state_slots=[s.state_slot for s in seqs],
    )
    return batch, LogitsPlan(sample_seqs=seqs)


def _build_general(chunks: list[ScheduledChunk], tables: BlockTables, block_size: int) -> tuple[BatchInput, LogitsPlan]:
    """Any mix of prefill chunks and decodes: one pass over the chunks."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    rows: list[int] = []
    state_slots: list[int | None] = []
    logits_indices: list[int] = []
    plan = LogitsPlan()
    prompt_rows: list[int] = []
    draft_rows: list[int] = []
    width = 0
    row = 0
    for chunk in chunks:
        seq, n = chunk.seq, chunk.num_new_tokens
        start = seq.num_computed_tokens
        end = start + n
        positions.extend(range(start, end))
        if chunk.num_drafts:  # the last token and its drafts
            drafts = list(seq.draft_token_ids)
            input_ids.append(seq.token_ids[start])
            input_ids.extend(drafts)
        else:
            input_ids.extend(seq.token_ids[start:end])
        query_lens.append(n)
        seq_lens.append(end)
        rows.append(seq.table_row)
        state_slots.append(seq.state_slot)
        width = max(width, len(seq.block_table))
        if chunk.num_drafts:  # sampled from the last token's row; the drafts' rows go last
            logits_indices.append(row)
            plan.verify.append((len(plan.sample_seqs), drafts))
            plan.sample_seqs.append(seq)
            draft_rows.extend(range(row + 1, row + n))
            row += n
            continue
        if end == len(seq.token_ids):  # the chunk completes the known tokens: a new token is sampled
            logits_indices.append(row + n - 1)
            plan.sample_seqs.append(seq)
        if seq.wants_prompt_logprobs:
            # Position p's logits give the logprob of prompt token p + 1; positions already
            # recorded (before a preemption) are skipped.
            first = max(start, len(seq.prompt_logprobs) - 1)
            last = min(end, seq.num_prompt_tokens - 1)
            if last > first:
                prompt_rows.extend(range(row + first - start, row + last - start))
                plan.prompt_logprob_spans.append((seq, first, last - first))
        row += n
    logits_indices.extend(prompt_rows)
    logits_indices.extend(draft_rows)
    block_tables = tables.gather(rows, width)
    batch = BatchInput(input_ids, positions, kv_slots(block_tables, query_lens, positions, block_size), query_lens,
                       seq_lens, block_tables, logits_indices, state_slots)
    n = query_lens[0] if query_lens else 0
    if n > 1 and len(plan.verify) == len(chunks) and len(logits_indices) == len(input_ids) and \
            all(m == n for m in query_lens):
        batch.verify_rows = n
    return batch, plan


def kv_slots(block_tables: np.ndarray, query_lens: list[int], positions: list[int], block_size: int) -> list[int]:
    """The KV-cache slot of every token: its sequence's block at position // block_size, times
    block_size, plus position % block_size."""
    pos = np.asarray(positions, dtype=np.int64)
    if len(positions) == len(query_lens):  # one token per sequence (decode rows)
        seq_of_token = np.arange(len(query_lens))
    else:
        seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
    blocks = block_tables[seq_of_token, pos // block_size].astype(np.int64)
    return (blocks * block_size + pos % block_size).tolist()
