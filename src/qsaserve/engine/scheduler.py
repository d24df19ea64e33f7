"""Scheduler: continuous batching with chunked prefill under a per-step token budget.

Each step it first advances running sequences (decodes and unfinished prefill chunks), in
arrival order, then admits waiting ones while the token budget, max_num_seqs and free KV
blocks allow. Prefill and decode share one budget, so a long prompt is split into chunks and
never stalls decodes. When blocks run out, the newest running sequence is preempted by
recompute: its blocks are freed and it goes back to the front of the queue; since sampled
tokens are kept (and seeded generators are not rewound), its output does not change.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from qsaserve.engine.block_manager import BlockManager
from qsaserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens
    num_drafts: int = 0  # of which drafted tokens to verify (the last num_drafts; engine/spec_decode.py)

    @property
    def completes_known_tokens(self) -> bool:
        """True when this chunk reaches the last known token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Every chunk is a decode: one new token after a fully computed prompt (the batch builder's fast path).
    all_decode: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, token_budget: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.token_budget = token_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.held: list[Sequence] | None = None  # finished sequences keeping their blocks (hold_finished)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget

        # 1. Running sequences, oldest first; preempt from the newest end when blocks run out.
        i = 0
        num_decodes = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.at_max_tokens:  # its in-flight token is its last (async scheduling): nothing to run
                i += 1
                continue
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            num_drafts = 0
            if remaining == 1 and seq.draft_token_ids:  # a verify chunk: the last token and its drafts
                del seq.draft_token_ids[budget - 1:]
                num_drafts = len(seq.draft_token_ids)
                remaining += num_drafts
            num_new = min(remaining, budget)
            while not self.block_manager.allocate(seq, num_new):
                if num_drafts:  # drafts never cost a sequence its blocks: drop them first
                    seq.draft_token_ids = []
                    num_new, num_drafts = num_new - num_drafts, 0
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.chunks.append(ScheduledChunk(seq, num_new, num_drafts))
                budget -= num_new
                if remaining == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                    num_decodes += 1
                i += 1
                continue
            break  # seq itself was preempted

        # 2. Waiting sequences, unless this step already had to preempt (no room to grow).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            cached = self.block_manager.find_cached_prefix(seq) if seq.num_computed_tokens == 0 else []
            num_new = min(seq.num_tokens - seq.num_computed_tokens - len(cached) * self.block_manager.block_size, budget)
            if not self.block_manager.allocate(seq, num_new, cached):
                break
            if seq.num_preemptions == 0 and seq.num_output_tokens == 0:
                seq.num_cached_tokens = len(cached) * self.block_manager.block_size
                self.block_manager.record_lookup(seq.num_prompt_tokens, seq.num_cached_tokens)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, num_new))
            budget -= num_new
        out.all_decode = num_decodes == len(out.chunks) > 0
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.draft_token_ids = []  # it restarts by recompute; drafts come again once it decodes
        seq.spec_restore_row = None
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, cacheable: bool = True) -> None:
        """Remove a finished or aborted sequence and free its blocks (after release_held while
        finished sequences are held; never one that is not cacheable)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.held is not None and cacheable:
            self.held.append(seq)
        else:
            self.block_manager.free_seq(seq, cacheable=cacheable)
        seq.status = SequenceStatus.FINISHED

    def hold_finished(self) -> None:
        """Until release_held, sequences finishing keep their blocks, block tables and state
        slots: the MTP head writes its pages of their last step's rows before the blocks go to the
        prefix cache (engine/spec_decode.py, mtp_request). Nothing is scheduled in between."""
        self.release_held()
        self.held = []

    def release_held(self) -> None:
        held, self.held = self.held or [], None
        for seq in held:
            self.block_manager.free_seq(seq)
