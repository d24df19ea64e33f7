"""Speculative decoding, engine side: drafts proposed on the host after each step, verified by
the next step in one target forward over the last token and its drafts (k + 1 query rows of one
sequence, beside the other sequences' decode and prefill rows), then the rejected tail rolled
back (docs/speculative.md).

Rollback. KV: the sequence's computed length goes back to the accepted prefix and the blocks past
it are freed (block_manager.rollback); the rejected positions' K/V are overwritten when those
positions are computed again, and nothing reads a position at or past a sequence's length.
Recurrent state (hybrid models: GDN conv + delta rule, PLE n-gram context + conv, QSA index
tail): the verify step writes the state after each of its first k positions into per-position
rows of the state-snapshot pool (k rows per state slot, beside the prefix cache's rows, through
the same in-chunk snapshot path); the slot itself ends after all k + 1 rows. When a draft is
rejected the next step first restores the row of the accepted prefix into the slot, so the state
is that of a run that never saw the rejected drafts, without recomputing anything.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from qsaserve.engine.block_manager import BlockManager, StateSnapshotPlan
from qsaserve.engine.draft_policy import RETIRE_AFTER, DraftPolicy
from qsaserve.engine.batch import PLACEHOLDER_TOKEN, TokenFeed
from qsaserve.engine.mtp_drafter import DeferredDrafts, MtpDraftRequest, full_request, uniform_step_rows
from qsaserve.engine.ngram_proposer import propose_ngram
from qsaserve.engine.rejection_sampler import VerifiedDrafts, verify_drafts_on_device
from qsaserve.engine.sampler import to_device
from qsaserve.engine.scheduler import ScheduledChunk
from qsaserve.engine.sequence import Sequence
from qsaserve.parallel.dcp import DcpGeometry
from qsaserve.speculative_config import SpeculativeConfig


@dataclass
class SpecDecodeStats:
    """Counters over the engine's life. A verify is one sequence's drafts checked in one step."""

    num_speculative_tokens: int
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of which accepted
    verifies: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: verifies that accepted draft i
    topped_up: int = 0  # of the drafted, tokens added by SpecDecoder.align_drafts (not found by a lookup)
    # Steps decided by the automatic fallback (draft_policy.py): sequences could draft / were kept from it.
    drafting_steps: int = 0
    fallback_steps: int = 0
    retired: int = 0  # sequences the fallback stopped from drafting for good (draft_policy.retires)

    def __post_init__(self) -> None:
        self.accepted_per_position = [0] * self.num_speculative_tokens

    @property
    def acceptance_length(self) -> float:
        """Mean tokens a verify emits (accepted drafts + the target's token), vLLM's definition."""
        return 1.0 + self.accepted / self.verifies if self.verifies else 0.0

    def as_dict(self) -> dict:
        per_pos = [a / self.verifies if self.verifies else 0.0 for a in self.accepted_per_position]
        return {"drafted": self.drafted, "accepted": self.accepted, "verifies": self.verifies,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "acceptance_length": self.acceptance_length, "accepted_per_position": list(self.accepted_per_position),
                "acceptance_rate_per_position": per_pos, "topped_up": self.topped_up,
                "drafting_steps": self.drafting_steps,
                "fallback_steps": self.fallback_steps, "retired": self.retired}


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, state_rows_base: int | None,
                 prefix_caching: bool = False, verify_graphs: bool = False):
        """state_rows_base: first pool row of the per-position state rows (k per state slot, slot s
        at base + s * k), None for models without recurrent state. prefix_caching: the MTP head
        runs on every sequence's rows, so that a cached block holds the head's pages for a later
        request that hits it (else only sequences that may draft run it)."""
        self.config = config
        self.head_on_every_sequence = prefix_caching and config.method == "mtp"
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.state_rows_base = state_rows_base
        self.stats = SpecDecodeStats(self.k)
        # The head's drafts of the last step, still on the device: (drafts, sequence -> (its batch
        # index then, its placeholder list)); defer_drafts / draft_feed / resolve_drafts.
        self._pending: tuple[DeferredDrafts, dict[Sequence, tuple[int, list[int]]]] | None = None
        self.policy = (DraftPolicy(on_decision=self._count_decision, retire_after=RETIRE_AFTER)
                       if config.disable_when_slower else None)
        # Sequences the fallback retired (draft_policy.retires): they never draft again; and each
        # running sequence's policy.plain_confirmations when it first ran (it retires once that
        # many more confirmed plain steps while it ran).
        self._retired: weakref.WeakSet[Sequence] = weakref.WeakSet()
        self._confirmations_at_start: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()
        self._step_seqs: list[Sequence] = []
        self.model_drafts = config.method == "mtp"
        # align_drafts acts only where a uniform verify replays a CUDA graph (verify_graphs: the
        # runner captured them): elsewhere a topped-up draft is only more rows.
        self.align = verify_graphs
        # Each drafting sequence's token ids as an int64 array, extended by the tokens appended
        # since (converting the whole list would cost its length, every sequence, every step).
        self._ids: weakref.WeakKeyDictionary[Sequence, tuple[np.ndarray, int]] = weakref.WeakKeyDictionary()

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Sequences whose distribution is a plain softmax (greedy or temperature) draft. A
        grammar-constrained one does not: its verified rows would each need the grammar's mask
        after the drafts before it, which the step does not build."""
        return seq.simple_sampling and seq.params.structured_outputs is None

    def needs_host_tokens(self, seq: Sequence) -> bool:
        """Whether a step with seq runs synchronously: its drafts, or the MTP head's rows for it,
        need its tokens on the host right after the step."""
        return self.head_on_every_sequence or self.may_draft(seq)

    def may_draft(self, seq: Sequence) -> bool:
        """eligible() and not retired by the fallback (a retired sequence's head pages are stale)."""
        return self.eligible(seq) and seq not in self._retired

    # ---- drafting ----
    def propose(self, seq: Sequence, num_running: int = 1) -> None:
        """Sets seq.draft_token_ids for its next step; never more than the request may still emit
        (one token is always the target's) nor past max_model_len; none while more than
        disable_by_batch_size sequences run."""
        k = self.room(seq, num_running)
        c = self.config
        seq.draft_token_ids = propose_ngram(self._token_array(seq), k, c.prompt_lookup_max, c.prompt_lookup_min) \
            if k > 0 and not self.model_drafts else []  # the model's drafts come after the step (mtp_request)

    def align_drafts(self, running: list[Sequence]) -> None:
        """n-gram drafts, after every running sequence proposed: when some sequences drafted n
        tokens and the others fewer, the others are topped up to n, so that the next step is a
        uniform verify (one CUDA graph of n + 1 rows a sequence) rather than a mixed step that runs
        eagerly. The top-up is the 1-gram continuation (the tokens after the last token's latest
        earlier occurrence), then the last token repeated. Verification keeps the target's tokens
        whatever the drafts are, so this costs acceptance per draft, never exactness; the automatic
        fallback times these steps as any other verify. Nothing changes unless every short
        sequence can take n drafts (it decodes next, may draft, has the room), since one that
        cannot leaves the step mixed anyway. Only with verify graphs (self.align)."""
        if not self.align or self.model_drafts or not running:
            return
        n = max(len(seq.draft_token_ids) for seq in running)
        short = [seq for seq in running if len(seq.draft_token_ids) < n]
        if not n or not short:
            return
        for seq in short:
            if seq.is_finished or seq.num_tokens - seq.num_computed_tokens != 1 or self.room(seq, len(running)) < n:
                return
        for seq in short:
            drafts = seq.draft_token_ids or propose_ngram(self._token_array(seq), n, 1, 1)
            fill = drafts[-1] if drafts else seq.token_ids[-1]
            self.stats.topped_up += n - len(seq.draft_token_ids)
            seq.draft_token_ids = (drafts + [fill] * n)[:n]

    def room(self, seq: Sequence, num_running: int) -> int:
        """Drafts seq may take next step (0: none)."""
        limit = self.config.disable_by_batch_size
        if seq.is_finished or not self.may_draft(seq) or (limit is not None and num_running > limit):
            return 0
        if self.policy is not None and not self.policy.allows():
            return 0
        room = self.max_model_len - seq.num_tokens - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(0, min(self.k, room))

    # ---- the step's timing (the automatic fallback, draft_policy.py) ----
    def begin_step(self, chunks: list[ScheduledChunk]) -> None:
        if self.policy is not None:
            if self.policy.retire_after is not None:  # what retirement needs at end_step
                self._step_seqs = [c.seq for c in chunks]
                for seq in self._step_seqs:
                    self._confirmations_at_start.setdefault(seq, self.policy.plain_confirmations)
            self.policy.step_started(len(chunks), all(c.num_new_tokens == c.num_drafts + 1 for c in chunks),
                                     any(c.num_drafts for c in chunks))

    def end_step(self) -> None:
        """After the step's tokens are appended and the next drafts made (none, where the policy
        retires the step's sequences: those that ran through retire_after confirming probes)."""
        policy = self.policy
        if policy is not None:
            if policy.retires():
                for seq in self._step_seqs:
                    seen = policy.plain_confirmations - self._confirmations_at_start[seq]
                    if not seq.is_finished and seq not in self._retired and seen >= policy.retire_after:
                        self._retired.add(seq)
                        self.stats.retired += 1
            policy.step_finished()
        self._step_seqs = []

    def _count_decision(self, drafts: bool) -> None:
        if drafts:
            self.stats.drafting_steps += 1
        else:
            self.stats.fallback_steps += 1

    # ---- drafts of the model's own head (method "mtp", engine/mtp_drafter.py) ----
    def mtp_request(self, chunks: list[ScheduledChunk], first_positions: list[int],
                    num_running: int) -> MtpDraftRequest | None:
        """After a step's tokens are appended: per chunk, its rows whose next token is known (a
        rejected draft's rows never are) and the drafts wanted once they reach the last token.
        Sequences that can never draft (eligible() is fixed per request) are left out, unless the
        head's pages are kept for the prefix cache (head_on_every_sequence). Then a sequence that
        finished in the step still holds its blocks (Scheduler.hold_finished) and its rows run
        too, up to the one before its last token (which has no successor): the blocks it filled
        go to the prefix cache with the head's pages written."""
        rows, next_ids, drafts, tables = [], [], [], []
        for chunk, start in zip(chunks, first_positions):
            seq = chunk.seq
            released = seq.is_finished and not seq.block_table
            m = 0 if released or not self.needs_host_tokens(seq) else \
                max(0, min(chunk.num_new_tokens, seq.num_tokens - start - 1))
            rows.append(m)
            next_ids.append(seq.token_ids[start + 1 : start + 1 + m])
            drafts.append(self.room(seq, num_running) if m and start + m == seq.num_tokens - 1 else 0)
            tables.append(list(seq.block_table) if m else [])  # the head reads the tables of its rows only
        return MtpDraftRequest(rows, next_ids, drafts, tables) if any(rows) else None

    # ---- the head right after the step's tokens, on the device ----
    def head_right_after(self, chunks: list[ScheduledChunk], plan, batch, in_flight: bool, executor) -> bool:
        """Whether the MTP head can run over this step's rows before its tokens reach the host,
        fed them on the device (full_request + apply_device_tokens): a uniform step (every
        sequence decodes one token, or verifies as many drafts) of sequences that all draft,
        nothing in flight, on an executor whose head takes device tokens, and without prefix
        caching (whose head rows stop at a finishing sequence's last token, known only on the host)."""
        if (not self.model_drafts or self.head_on_every_sequence or in_flight or not executor.drafts_from_device_tokens
                or plan.prompt_logprob_spans or len(plan.sample_seqs) != len(chunks)):
            return False
        n = chunks[0].num_new_tokens
        if any(c.num_new_tokens != n or c.num_drafts != n - 1 or not self.may_draft(c.seq) for c in chunks):
            return False
        return uniform_step_rows(batch, DcpGeometry()) > 0  # every row has a known next token here

    def head_request(self, chunks: list[ScheduledChunk], batch, num_running: int) -> MtpDraftRequest:
        """head_right_after's host request (mtp_drafter.full_request): every row; k drafts for
        every sequence if any may draft (room before the step's tokens are appended bounds the
        room after), else none (the catch-up rows alone, as the fallback's plain steps want)."""
        k = self.k if any(self.room(c.seq, num_running) for c in chunks) else 0
        return full_request([c.seq.block_table for c in chunks], batch.query_lens, k)

    def wanted_drafts(self, chunks: list[ScheduledChunk], num_running: int) -> list[int]:
        """After the step's tokens are appended: the drafts each sequence takes of the head's k."""
        return [0 if c.seq.is_finished else self.room(c.seq, num_running) for c in chunks]

    # ---- the head's drafts, read after the next step is launched ----
    def defer_drafts(self, chunks: list[ScheduledChunk], drafts: DeferredDrafts) -> None:
        """The head's drafts of the step (chunks: its batch, in order) stay on the device: each
        live sequence that drafts gets placeholders for as many tokens, which the scheduler counts
        (and may cut) as drafts; the next step's draft rows take them from the device (draft_feed),
        and resolve_drafts writes them in once that step is launched."""
        self._pending = None
        placeholders = {}
        for i, (chunk, wanted) in enumerate(zip(chunks, drafts.wanted)):
            if wanted and i in drafts.row_of and not chunk.seq.is_finished:
                chunk.seq.draft_token_ids = [PLACEHOLDER_TOKEN] * wanted
                placeholders[chunk.seq] = (i, chunk.seq.draft_token_ids)
            elif not chunk.seq.is_finished:
                chunk.seq.draft_token_ids = []
        if placeholders:
            self._pending = (drafts, placeholders)

    def draft_feed(self, chunks: list[ScheduledChunk]) -> TokenFeed | None:
        """The step's draft rows whose tokens are still on the device (defer_drafts): input row
        dst (the chunk's rows: its last token, then its drafts) takes the head's draft j."""
        if self._pending is None:
            return None
        drafts, placeholders = self._pending
        steps = drafts.tokens.shape[1]
        dst, src, row = [], [], 0
        for chunk in chunks:
            held = placeholders.get(chunk.seq)
            if chunk.num_drafts and held is not None and chunk.seq.draft_token_ids is held[1]:
                first = drafts.row_of[held[0]] * steps
                dst += range(row + 1, row + 1 + chunk.num_drafts)
                src += range(first, first + chunk.num_drafts)
            row += chunk.num_new_tokens
        return TokenFeed(drafts.tokens.reshape(-1), dst, src) if dst else None

    def resolve_drafts(self, plan) -> None:
        """After the step that fed them is launched: the deferred drafts' values into their
        sequences (as many as the scheduler kept), and into the step's verify plan."""
        if self._pending is None:
            return
        drafts, placeholders = self._pending
        self._pending = None
        values = drafts.result()
        for seq, (i, held) in placeholders.items():
            if seq.draft_token_ids is held:  # not dropped or replaced since (preemption, finish)
                held[:] = values[i][: len(held)]
        if plan is not None and plan.verify:
            plan.verify = [(i, list(plan.sample_seqs[i].draft_token_ids)) for i, _ in plan.verify]

    def _token_array(self, seq: Sequence) -> np.ndarray:
        """seq.token_ids as an int64 array view (token ids are only ever appended to a drafting
        sequence: it never holds an async placeholder)."""
        buf, n = self._ids.get(seq, (np.empty(0, dtype=np.int64), 0))
        total = seq.num_tokens
        if total > buf.size:
            grown = np.empty(max(2 * buf.size, total + 64), dtype=np.int64)
            grown[:n] = buf[:n]
            buf = grown
        buf[n:total] = seq.token_ids[n:total]
        self._ids[seq] = (buf, total)
        return buf[:total]

    # ---- the verify step's state rows ----
    def plan_states(self, chunks: list[ScheduledChunk], plan: StateSnapshotPlan | None) -> StateSnapshotPlan | None:
        """Adds to the step's snapshot plan the restores of rejected steps and every verify chunk's
        per-position rows (offsets 1..drafts, merged with the prefix cache's interior offsets:
        a verify chunk has none of those, block_manager.plan_state_snapshots)."""
        if self.state_rows_base is None:
            return plan
        plan = plan or StateSnapshotPlan([], [], [], [], [[] for _ in chunks], [])
        rows: list[int] = []
        cursor = 0
        for chunk, offsets in zip(chunks, plan.interior_offsets):
            seq = chunk.seq
            theirs = plan.interior_rows[cursor : cursor + len(offsets)]
            cursor += len(offsets)
            if seq.spec_restore_row is not None:
                plan.restore_rows.append(seq.spec_restore_row)
                plan.restore_slots.append(seq.state_slot)
                seq.spec_restore_row = None
            if chunk.num_drafts:
                base = self.state_rows_base + seq.state_slot * self.k
                offsets[:] = list(range(1, chunk.num_drafts + 1))
                theirs = [base + j for j in range(chunk.num_drafts)]
            rows += theirs
        plan.interior_rows = rows
        return plan if plan else None

    # ---- verification ----
    def verify_logits(self, logits: torch.Tensor, plan) -> torch.Tensor:
        """[N, k + 1, V]: each verified sequence's row 0 (its sample row) and its draft rows (after
        the prompt-logprob rows), padded with row 0."""
        first_extra = len(plan.sample_seqs) + sum(count for _, _, count in plan.prompt_logprob_spans)
        rows, cursor = [], first_extra
        for index, drafts in plan.verify:
            extra = list(range(cursor, cursor + len(drafts)))
            cursor += len(drafts)
            rows.append([index] + extra + [index] * (self.k - len(drafts)))
        # pinned and non_blocking: a pageable copy would make the host wait for the step's forward
        # before it can launch the head behind it
        return logits[to_device(rows, torch.long, logits.device)]

    def verify(self, logits: torch.Tensor, plan, generator: torch.Generator) -> dict[int, tuple[list[int], bool]]:
        """seq_id -> (emitted tokens, all rows finite), for every verified sequence."""
        return self.verify_finish(self.verify_launch(logits, plan, generator), plan)

    def verify_launch(self, logits: torch.Tensor, plan, generator: torch.Generator) -> VerifiedDrafts:
        """The acceptance of every verified sequence, decided on the device (rows in plan.verify's
        order); verify_finish reads it back."""
        seqs = [plan.sample_seqs[i] for i, _ in plan.verify]
        return verify_drafts_on_device(self.verify_logits(logits, plan), [d for _, d in plan.verify], seqs, generator)

    def verify_finish(self, verified: VerifiedDrafts, plan) -> dict[int, tuple[list[int], bool]]:
        """verify_launch's outcome on the host, counted in the stats and the fallback policy."""
        seqs = [plan.sample_seqs[i] for i, _ in plan.verify]
        emitted, finite = verified.result()
        st = self.stats
        for tokens, (_, drafts) in zip(emitted, plan.verify):
            a = len(tokens) - 1
            st.verifies += 1
            st.drafted += len(drafts)
            st.accepted += a
            for i in range(a):
                st.accepted_per_position[i] += 1
            if self.policy is not None:
                self.policy.verified(a)
        return {s.seq_id: (tokens, ok) for s, tokens, ok in zip(seqs, emitted, finite)}

    def roll_back(self, seq: Sequence, num_drafts: int, num_accepted: int, block_manager: BlockManager) -> None:
        """After the step's _advance: the rejected drafts' KV positions and blocks go, and the next
        step restores the state after the accepted prefix (offset num_accepted + 1 of the chunk)."""
        rejected = num_drafts - num_accepted
        if not rejected or seq.is_finished:
            return
        block_manager.rollback(seq, seq.num_computed_tokens - rejected)
        if self.state_rows_base is not None:
            seq.spec_restore_row = self.state_rows_base + seq.state_slot * self.k + num_accepted
