"""The narrow interface between the engine and the model runner: one step's inputs as plain
lists (picklable, so the same object can be broadcast to worker ranks) plus the plan that
says which logits rows belong to whom."""
from __future__ import annotations

from dataclasses import dataclass, field

from qsaserve.engine.scheduler import ScheduledChunk
from qsaserve.engine.sequence import Sequence


@dataclass
class BatchInput:
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    seq_lens: list[int]  # context length of each sequence after this step
    block_tables: list[list[int]]
    logits_indices: list[int]  # token rows whose logits the runner returns, in this order
    state_slots: list[int]  # recurrent-state slot per sequence (hybrid models); a sequence whose
    # chunk starts at position 0 begins from a fresh state


@dataclass
class LogitsPlan:
    """What each returned logits row is for."""

    sample_seqs: list[Sequence] = field(default_factory=list)  # rows 0..len-1: one per sampled sequence
    # (sequence, first prompt position whose next-token logprob these rows give, number of rows)
    prompt_logprob_spans: list[tuple[Sequence, int, int]] = field(default_factory=list)


def build_batch(chunks: list[ScheduledChunk], block_size: int) -> tuple[BatchInput, LogitsPlan]:
    batch = BatchInput([], [], [], [], [], [], [], [])
    plan = LogitsPlan()
    prompt_rows: list[int] = []
    row = 0
    for chunk in chunks:
        seq, start, n = chunk.seq, chunk.seq.num_computed_tokens, chunk.num_new_tokens
        table = seq.block_table
        batch.input_ids.extend(seq.token_ids[start : start + n])
        batch.positions.extend(range(start, start + n))
        batch.slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        batch.query_lens.append(n)
        batch.seq_lens.append(start + n)
        batch.block_tables.append(table)
        batch.state_slots.append(seq.state_slot)
        if chunk.completes_known_tokens:
            batch.logits_indices.append(row + n - 1)
            plan.sample_seqs.append(seq)
        if seq.wants_prompt_logprobs:
            # Position p's logits give the logprob of prompt token p + 1; positions already
            # recorded (before a preemption) are skipped.
            first = max(start, len(seq.prompt_logprobs) - 1)
            last = min(start + n, seq.num_prompt_tokens - 1)
            if last > first:
                prompt_rows.extend(range(row + first - start, row + last - start))
                plan.prompt_logprob_spans.append((seq, first, last - first))
        row += n
    batch.logits_indices.extend(prompt_rows)
    return batch, plan
