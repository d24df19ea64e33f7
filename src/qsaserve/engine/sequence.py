"""Sequence: the engine-side state of one generated completion (a request with n > 1 has n of them)."""
from __future__ import annotations

import enum
import time

import torch

from qsaserve.outputs import PositionLogprobs
from qsaserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        seq_id: int,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None,
    ):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index  # position among the request's n completions
        self.params = params
        self.generator = generator  # per-request RNG (seeded requests); None: the engine's RNG
        # Greedy or plain temperature sampling: no penalties, min_tokens, top-k/top-p/min-p filters or
        # logprobs, so the sampler's batched path needs no per-sequence work (params never change).
        # Penalties read the output token ids on the host, so a step with such a row waits for
        # the previous step's tokens (no async scheduling overlap for it).
        self.uses_penalties = bool(params.repetition_penalty != 1.0 or params.presence_penalty
                                   or params.frequency_penalty)
        self.simple_sampling = (
            params.logprobs is None and params.min_tokens == 0 and not self.uses_penalties
            and params.top_k <= 0 and params.top_p >= 1.0 and params.min_p == 0.0
        )
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None

        # Cache state, owned by the block manager and the scheduler.
        self.block_table: list[int] = []
        self.table_row: int | None = None  # its row in the block manager's BlockTables while it holds blocks
        self.state_slot: int | None = None  # recurrent-state slot while it holds KV blocks
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache on first schedule
        self.num_preemptions = 0
        # Recurrent-state snapshots of the hybrid prefix cache (engine/state_cache.py): the row its
        # next step restores, and the rows its launched steps write (boundary token count, row).
        self.restore_state_row: int | None = None
        self.pending_state_saves: list[tuple[int, int]] = []
        # Speculative decoding (engine/spec_decode.py): tokens drafted after the last token, verified
        # by its next step; and the per-position state row its next step restores (hybrid models,
        # a step that rejected drafts), None when the slot already holds the right state.
        self.draft_token_ids: list[int] = []
        self.spec_restore_row: int | None = None

        # Output state, owned by the engine.
        self.output_text = ""
        self.cumulative_logprob = 0.0
        self.logprobs: list[PositionLogprobs] = []
        self.prompt_logprobs: list[PositionLogprobs | None] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stop_state = 0  # the stop strings' automaton state after output_text
        self.grammar = None  # structured outputs: its xgrammar matcher (engine/structured_output.py)
        self.detok_prefix_offset = 0
        self.detok_read_offset = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def at_max_tokens(self) -> bool:
        """Its output already has max_tokens tokens (counting one still being sampled, with async
        scheduling): it needs no further step."""
        return self.params.max_tokens is not None and self.num_output_tokens >= self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        # Computed once per request (by its first completion), until every prompt token has one.
        return self.index == 0 and self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, req={self.request_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"
