"""LLMEngine: requests in, RequestOutputs out, one scheduler step at a time.

It validates and tokenizes requests, asks the scheduler what to run, has the executor run it,
samples on rank 0's logits, detokenizes, applies stop conditions and frees finished requests.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from qsaserve.cache.kv_cache import usable_blocks as usable_kv_blocks
from qsaserve.config import EngineConfig
from qsaserve.engine.batch import PLACEHOLDER_TOKEN, LogitsPlan, TokenFeed, build_batch
from qsaserve.engine.block_manager import BlockManager
from qsaserve.engine.detokenizer import detokenize_incrementally
from qsaserve.engine.executor import make_executor
from qsaserve.engine.host_kv_tier import HostKVTier
from qsaserve.engine.model_runner import resolve_block_size
from qsaserve.engine.sampler import DeferredTokens, SampledToken, prompt_logprobs_for, sample, sample_deferred
from qsaserve.engine.scheduler import Scheduler, SchedulerOutput
from qsaserve.engine.spec_decode import SpecDecoder
from qsaserve.engine.state_cache import StateSnapshotCache
from qsaserve.engine.structured_output import StructuredOutputs
from qsaserve.engine.sequence import Sequence
from qsaserve.errors import InvalidRequestError
from qsaserve.loader.resolve import dummy_checkpoint, load_checkpoint, load_tokenizer, resolve_model
from qsaserve.models.registry import check_model_parallel, is_hybrid, text_config
from qsaserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from qsaserve.quant.kv_scales import capacity_report
from qsaserve.sampling_params import SamplingParams

logger = logging.getLogger("qsaserve")


@dataclass
class _InFlight:
    """A step run on the device: its schedule, its logits plan, the tokens still on their way
    back (async scheduling; None once sampled on the host) and the sequences that filled a block."""
    sched: SchedulerOutput
    plan: LogitsPlan
    tokens: DeferredTokens | None
    filled: list[Sequence]


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float


class LLMEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True):
        self.config = config
        if config.load_format == "dummy":
            checkpoint = dummy_checkpoint(config.model)
        else:
            checkpoint = load_checkpoint(resolve_model(config.model, progress=progress), progress=progress)
        self.checkpoint = checkpoint
        self.tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer is not None else checkpoint.tokenizer
        hf = text_config(checkpoint.hf_config)
        self.vocab_size = hf["vocab_size"]
        self.max_model_len = resolve_max_model_len(config, hf)
        self.eos_token_ids = _eos_ids(hf, self.tokenizer)
        check_model_parallel(hf, config.tensor_parallel_size, config.decode_context_parallel_size)
        self.config = config = resolve_block_size(config, hf)
        prefix_caching = self._prefix_caching(config, hf)
        if config.kv_offload_gib and not prefix_caching:
            raise InvalidRequestError("kv_offload_gib", "the host tier holds what the prefix cache evicts: it needs "
                                      "prefix caching (--enable-prefix-caching)")

        self.executor = make_executor(config, checkpoint, self.max_model_len, progress=progress)
        try:
            block_size = self._check_kv_capacity()
            self.block_manager = BlockManager(self.executor.num_kv_blocks, block_size, prefix_caching, config.num_state_slots,
                                              self._state_cache(prefix_caching), self._host_tier())
        except BaseException:
            self.executor.shutdown()
            raise
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.token_budget)
        self.generator = torch.Generator(device=self.executor.device).manual_seed(config.seed)
        self.requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "finished": 0, "errors": 0}
        self._in_flight: _InFlight | None = None  # async scheduling: the step whose tokens are on their way
        self.structured_outputs = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.spec: SpecDecoder | None = None
        if config.speculative_config is not None:
            # Hybrid models keep k per-position state rows per slot after the prefix cache's rows.
            base = self.executor.num_state_snapshots if is_hybrid(hf) else None
            self.spec = SpecDecoder(config.speculative_config, self.max_model_len, base, prefix_caching,
                                    self.executor.verify_graphs)

    def _check_kv_capacity(self) -> int:
        """Refuses a cache that cannot hold one max-length request, logs the capacity (per rank under
        parallelism, next to DCP1's at the same memory), returns tokens per engine block."""
        spec, block_size = self.executor.kv_spec, self.executor.block_size
        usable_blocks = usable_kv_blocks(self.executor.num_kv_blocks)
        per_request = spec.blocks_for(self.max_model_len)
        if usable_blocks < per_request:
            raise InvalidRequestError(
                "kv_cache_memory",
                f"the KV cache holds {usable_blocks * block_size} tokens "
                f"({spec.bytes_per_token} bytes/token), less than one max_model_len={self.max_model_len} request; "
                "raise kv_cache_memory / gpu_memory_utilization or lower max_model_len",
            )
        per_rank = " per rank" if self.config.tensor_parallel_size > 1 else ""
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB%s, %s), %.1f concurrent max-length requests",
            usable_blocks, block_size, usable_blocks * block_size,
            self.executor.num_kv_blocks * spec.bytes_per_block / 2**20, per_rank, self.executor.kv_quant.name,
            usable_blocks / per_request,
        )
        logger.info(capacity_report(spec, self.executor.kv_budget_bytes, self.executor.kv_quant))
        ours, dcp1 = self.executor.capacity(self.max_model_len)
        if ours.dcp_size > 1:
            logger.info(
                "KV capacity at the same per-rank memory: DCP%d %d tokens / %.1f max-length requests; DCP1 %d tokens / "
                "%.1f (x%.2f)", ours.dcp_size, ours.tokens, ours.max_len_requests, dcp1.tokens, dcp1.max_len_requests,
                ours.tokens / max(dcp1.tokens, 1),
            )
        return block_size

    def _state_cache(self, prefix_caching: bool) -> StateSnapshotCache | None:
        """The recurrent-state half of a hybrid model's prefix cache, logged with its memory."""
        ex = self.executor
        if not prefix_caching or not ex.num_state_snapshots:
            return None
        cache = StateSnapshotCache(ex.num_state_snapshots, ex.state_interval, ex.state_snapshot_bytes)
        per_rank = " per rank" if self.config.tensor_parallel_size > 1 else ""
        logger.info("prefix cache: recurrent-state snapshots every %d tokens, %d x %.1f KiB = %.1f MiB%s (one per %d "
                    "tokens of KV the cache holds)", cache.interval, cache.num_rows, cache.row_bytes / 1024,
                    cache.nbytes / 2**20, per_rank, cache.interval)
        return cache

    def _host_tier(self) -> HostKVTier | None:
        """The host-memory tier of the prefix cache (--kv-offload-gib), logged with its memory."""
        ex = self.executor
        if not self.config.kv_offload_gib:
            return None
        tier = HostKVTier(ex.num_host_kv_blocks, ex.host_kv_block_bytes, ex.num_host_snapshots, ex.state_snapshot_bytes)
        if not tier.kv.num_slots:
            raise InvalidRequestError("kv_offload_gib", f"{self.config.kv_offload_gib} GiB holds no KV block "
                                      f"({ex.host_kv_block_bytes} bytes per block)")
        per_rank = " per rank" if self.config.tensor_parallel_size > 1 else ""
        snapshots = f" + {ex.num_host_snapshots} state snapshots" if ex.num_host_snapshots else ""
        logger.info("host KV tier: %d blocks (%d tokens)%s = %.1f MiB of pinned host memory%s", tier.kv.num_slots,
                    tier.kv.num_slots * ex.block_size, snapshots, tier.nbytes / 2**20, per_rank)
        return tier

    def check_health(self) -> None:
        """Raises EngineDeadError when a worker rank has died (the server reports it)."""
        self.executor.check_health()

    @staticmethod
    def _prefix_caching(config: EngineConfig, hf_config: dict) -> bool:
        """On by default; hybrid models (whose hits also restore a recurrent-state snapshot) only
        when asked for."""
        if not is_hybrid(hf_config):
            return config.enable_prefix_caching is not False
        return bool(config.enable_prefix_caching)

    # ---- requests ----
    def add_request(
        self, request_id: str, prompt: str | dict | list[int], params: SamplingParams | None = None
    ) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        self._validate(token_ids, params)
        if params.structured_outputs is not None:
            # The server and LLM.generate compile before adding (off this thread), so this wait
            # is a cache hit for them; a grammar that cannot compile is refused here.
            self.structured_outputs.compile(params.structured_outputs).result()
        seqs = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            gen = torch.Generator(device=self.executor.device).manual_seed(seed) if seed is not None else None
            seq = Sequence(next(self._seq_ids), request_id, i, token_ids, params, gen)
            seqs.append(seq)
        self.requests[request_id] = _Request(request_id, text, token_ids, params, seqs, time.monotonic())
        for seq in seqs:
            self.scheduler.add(seq)
        self.stats["prompt_tokens"] += len(token_ids)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "this model has no tokenizer; pass {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise InvalidRequestError("prompt_token_ids", "must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise InvalidRequestError("prompt", "a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError("prompt", f"must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt", "must contain at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError("prompt_token_ids", f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        n = len(token_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"the prompt has {n} tokens; max_model_len is {self.max_model_len} (room for one output token needed)"
            )
        if n + params.min_tokens > self.max_model_len:
            raise InvalidRequestError(
                "min_tokens", f"prompt ({n} tokens) + min_tokens ({params.min_tokens}) exceeds max_model_len {self.max_model_len}"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} exceeds max_model_len {self.max_model_len}",
            )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.is_finished:
                if seq.token_ids[-1] == PLACEHOLDER_TOKEN:  # its in-flight token is dropped
                    seq.token_ids.pop()
                self.scheduler.finish(seq)
                seq.finish_reason = "abort"
        return self._make_output(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ----
    # One call: schedule, build the batch, run it, sample, then the host work on the results
    # (tokens appended, stop conditions, outputs). With async_scheduling a step without penalized
    # rows or prompt logprobs leaves its sampled tokens on the device: they go
    # into the next step's input ids there (TokenFeed), the host marks them with placeholders,
    # and the next call launches its own step before reading them back. The host work of step N
    # thus runs while the device computes step N+1. A sequence that stopped at step N on a token
    # or string has still computed step N+1; that row is dropped (its KV write lands in blocks it
    # just freed, before any later step reuses them, in stream order). One that reaches max_tokens
    # is known to stop and is not scheduled again (Sequence.at_max_tokens).
    def step(self, outputs: str = "all") -> list[RequestOutput]:
        """Runs one scheduler step. outputs="all" returns an output for every request that made
        progress (streaming consumers: the async engine); "finished" only for the requests that
        finished in this step, skipping the per-step building of everyone else's output (offline
        generation, which reads only final results). With async scheduling a step's outputs come
        from the call after it."""
        if outputs not in ("all", "finished"):
            raise InvalidRequestError("outputs", f"must be 'all' or 'finished', got {outputs!r}")
        prev, self._in_flight = self._in_flight, None
        results: list[RequestOutput] = []
        sched = self.scheduler.schedule()
        feed = self._feed_from(prev, sched) if prev is not None and sched else None
        if prev is not None and feed is None:  # no in-flight sequence runs now: finish that step first
            results += self._complete_in_flight(prev, outputs)
            prev = None
            sched.chunks = [c for c in sched.chunks if not c.seq.is_finished]
        if not sched:
            return results
        batch, plan = build_batch(sched.chunks, self.block_manager.tables, self.executor.block_size,
                                  sched.all_decode)
        if self.block_manager.state_cache is not None:
            batch.state_snapshots = self.block_manager.plan_state_snapshots(sched.chunks)
        batch.host_transfers = self.block_manager.take_host_transfers()
        if self.spec is not None:
            batch.state_snapshots = self.spec.plan_states(sched.chunks, batch.state_snapshots)
            self.spec.begin_step(sched.chunks)
            drafts_fed = self.spec.draft_feed(sched.chunks)  # the last step's MTP drafts, still on the device
            if drafts_fed is not None:
                feed = drafts_fed if feed is None else feed.merged(drafts_fed)
        logits = self.executor.execute(batch, feed) if feed is not None else self.executor.execute(batch)
        if self.spec is not None:  # their values, now that the step that reads them is queued
            self.spec.resolve_drafts(plan)
        if self.block_manager.state_cache is not None:
            self.block_manager.release_launched_restores()
        if batch.host_transfers is not None:
            self.block_manager.release_launched_host_transfers()
        num_sampled = len(plan.sample_seqs)
        if prev is not None and any(s.params.structured_outputs is not None for s in plan.sample_seqs):
            # A grammar's mask needs its matcher past the in-flight token: that step's host work
            # comes first (this step's forward is already queued on the device meanwhile).
            results += self._complete_in_flight(prev, outputs)
            prev = None
        mask = self.structured_outputs.batch_mask(plan.sample_seqs) if num_sampled else None
        if (self.config.async_scheduling and num_sampled and not plan.prompt_logprob_spans
                and not any(s.uses_penalties for s in plan.sample_seqs)
                # A sequence that drafts needs its tokens on the host before the next step (the
                # drafter reads them), so such steps run synchronously under async scheduling.
                and not (self.spec is not None and any(self.spec.needs_host_tokens(s) for s in plan.sample_seqs))):
            tokens = sample_deferred(logits[:num_sampled], plan.sample_seqs, self.eos_token_ids, self.generator, mask)
            if prev is not None:
                results += self._complete_in_flight(prev, outputs)
            filled = self._advance(sched)
            live = [seq for seq in plan.sample_seqs if not seq.is_finished]
            for seq in live:
                seq.token_ids.append(PLACEHOLDER_TOKEN)
            if live:  # otherwise every row of it is dropped anyway
                self._in_flight = _InFlight(sched, plan, tokens, filled)
            return results
        errored = self._record_prompt_logprobs(logits, plan)
        head_drafts = None
        if self.spec is not None and self.spec.head_right_after(sched.chunks, plan, batch, prev is not None, self.executor):
            # The MTP head over this step's rows, fed its tokens on the device before they are
            # read: everything the host reads back is queued before the head.
            on_device = self.spec.verify_launch(logits, plan, self.generator) if plan.verify else None
            tokens = sample_deferred(logits[:num_sampled], plan.sample_seqs, self.eos_token_ids, self.generator)
            fed = (on_device.emitted, on_device.num_emitted) if on_device else (tokens.tokens, torch.ones_like(tokens.tokens))
            request = self.spec.head_request(sched.chunks, batch, len(self.scheduler.running))
            head_drafts = self.executor.mtp_draft(request, fed)
            verified = self.spec.verify_finish(on_device, plan) if on_device else None
            sampled = tokens.result()
        else:
            verified = self.spec.verify(logits, plan, self.generator) if plan.verify else None
            sampled = sample(logits[:num_sampled], plan.sample_seqs, self.eos_token_ids, self.generator, mask) \
                if num_sampled else []
        if prev is not None:
            results += self._complete_in_flight(prev, outputs)
        filled = self._advance(sched)
        if verified:
            self._roll_back(sched, verified)
        hold = self.spec is not None and self.spec.head_on_every_sequence
        if hold:  # the head's pages of the rows of sequences finishing now, before their blocks are cached
            self.scheduler.hold_finished()
        results += self._complete(_InFlight(sched, plan, None, filled), sampled, errored, outputs, verified)
        if head_drafts is not None:  # the head already ran: each sequence keeps the drafts it may take
            head_drafts.wanted = self.spec.wanted_drafts(sched.chunks, len(self.scheduler.running))
            self.spec.defer_drafts(sched.chunks, head_drafts)
        elif self.spec is not None and self.spec.model_drafts:  # the MTP head, in this step (mtp_drafter.py)
            starts = itertools.accumulate(batch.query_lens[:-1], initial=0)
            request = self.spec.mtp_request(sched.chunks, [batch.positions[i] for i in starts], len(self.scheduler.running))
            if request is not None:  # read back once the next step is launched (spec.draft_feed)
                self.spec.defer_drafts(sched.chunks, self.executor.mtp_draft(request))
        if hold:
            self.scheduler.release_held()
        if self.spec is not None:
            self.spec.end_step()
        return results

    def _roll_back(self, sched: SchedulerOutput, verified: dict[int, tuple[list[int], bool]]) -> None:
        """The rejected drafts of the step's verify chunks (spec_decode.py)."""
        for chunk in sched.chunks:
            if chunk.num_drafts and not chunk.seq.is_finished:
                tokens, _ = verified[chunk.seq.seq_id]
                self.spec.roll_back(chunk.seq, chunk.num_drafts, len(tokens) - 1, self.block_manager)

    def _feed_from(self, prev: "_InFlight", sched: SchedulerOutput) -> TokenFeed | None:
        """The in-flight step's device tokens as this step's input ids, row by row."""
        src_of = {id(seq): i for i, seq in enumerate(prev.plan.sample_seqs)}
        dst, src = [], []
        row = 0
        for chunk in sched.chunks:
            seq = chunk.seq
            if seq.token_ids[-1] == PLACEHOLDER_TOKEN:  # its last token is still on the device
                dst.append(row + chunk.num_new_tokens - 1)
                src.append(src_of[id(seq)])
            row += chunk.num_new_tokens
        return TokenFeed(prev.tokens.tokens, dst, src) if dst else None

    def _advance(self, sched: SchedulerOutput) -> list[Sequence]:
        """Counts the step's computed tokens; returns the sequences that filled a block (published
        to the prefix cache once the step's results are known to be finite)."""
        block_size = self.block_manager.block_size
        filled = []
        for chunk in sched.chunks:
            seq = chunk.seq
            if seq.is_finished:  # stopped by the step before, whose results came in after this one ran
                continue
            before = seq.num_computed_tokens
            seq.num_computed_tokens = before + chunk.num_new_tokens
            if seq.num_computed_tokens // block_size != before // block_size:
                filled.append(seq)
        return filled

    def _complete_in_flight(self, step: "_InFlight", outputs: str) -> list[RequestOutput]:
        """Waits for a deferred step's tokens (only their copy), then its host work."""
        return self._complete(step, step.tokens.result(), set(), outputs)

    def _complete(self, step: "_InFlight", sampled: list[SampledToken], errored: set[int],
                  outputs: str, verified: dict[int, tuple[list[int], bool]] | None = None) -> list[RequestOutput]:
        """The host work on a step's results: stop conditions, tokens, outputs. verified: the
        tokens each verify chunk emits (speculative decoding), in place of its sampled token."""
        plan = step.plan
        verified = verified or {}
        for seq, tok in zip(plan.sample_seqs, sampled):
            if not tok.finite or not verified.get(seq.seq_id, ((), True))[1]:
                errored.add(seq.seq_id)
        for seq in step.filled:  # a verify chunk's accepted drafts join token_ids below: hashed after them
            if seq.seq_id not in errored and not seq.is_finished and seq.seq_id not in verified:
                self.block_manager.cache_computed_blocks(seq)
        now = time.monotonic()
        requests = self.requests
        touched: dict[str, _Request] = {}
        appended = 0
        ended: list[_Request] = []  # requests one of whose sequences finished in this step
        for seq, tok in zip(plan.sample_seqs, sampled):
            if seq.is_finished:
                continue
            if step.tokens is not None:
                seq.token_ids.pop()  # its placeholder
            if seq.seq_id in errored:
                seq.finish_reason = "error"
                self.scheduler.finish(seq, cacheable=False)
                self.stats["errors"] += 1
                logger.error("request %s: non-finite logits; ended with finish_reason=error", seq.request_id)
            elif seq.seq_id in verified:
                for token in verified[seq.seq_id][0]:
                    self._append_token(seq, SampledToken(token, None, None, None, True), now)
                    appended += 1
                    if seq.is_finished:
                        break
                else:
                    self.block_manager.cache_computed_blocks(seq)
            else:
                self._append_token(seq, tok, now)
                appended += 1
            if self.spec is not None and not seq.is_finished:
                self.spec.propose(seq, len(self.scheduler.running))
            req = requests[seq.request_id]
            touched[seq.request_id] = req
            if seq.is_finished:
                ended.append(req)
        self.stats["generation_tokens"] += appended
        if self.spec is not None:  # after every sequence proposed: n-gram drafts of equal length
            self.spec.align_drafts(self.scheduler.running)
        for seq, _, _ in plan.prompt_logprob_spans:
            touched.setdefault(seq.request_id, requests[seq.request_id])
        done = {req.request_id for req in ended if all(s.is_finished for s in req.seqs)}
        results = [self._make_output(req) for req in touched.values() if outputs == "all" or req.request_id in done]
        for request_id in done:
            del requests[request_id]
        self.stats["finished"] += len(done)
        return results

    def _record_prompt_logprobs(self, logits: torch.Tensor, plan: LogitsPlan) -> set[int]:
        errored: set[int] = set()
        row = len(plan.sample_seqs)
        for seq, first, count in plan.prompt_logprob_spans:
            rows = logits[row : row + count]
            row += count
            if not bool(torch.isfinite(rows).all()):
                errored.add(seq.seq_id)
                continue
            if not seq.prompt_logprobs:
                seq.prompt_logprobs.append(None)  # the first prompt token has no context
            targets = seq.token_ids[first + 1 : first + 1 + count]
            for target, (lp, rank, top) in zip(targets, prompt_logprobs_for(rows, targets, seq.params.prompt_logprobs)):
                seq.prompt_logprobs.append(self._logprob_dict(target, lp, rank, top))
        return errored

    def _logprob_dict(self, token: int, logprob: float, rank: int, top: list[tuple[int, float]]) -> dict[int, Logprob]:
        entries = {tid: Logprob(lp, r + 1, self._decode_token(tid)) for r, (tid, lp) in enumerate(top)}
        entries[token] = Logprob(logprob, rank, self._decode_token(token))
        return entries

    def _decode_token(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _append_token(self, seq: Sequence, tok: SampledToken, now: float) -> None:
        token = tok.token_id
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if seq.grammar is not None and not self.structured_outputs.accept(seq, token):
            # Only possible when another mask (min_tokens) removed every token the grammar allowed.
            logger.error("request %s: token %d breaks its grammar; ended with finish_reason=error", seq.request_id, token)
            seq.finish_reason = "error"
            self.scheduler.finish(seq, cacheable=False)
            self.stats["errors"] += 1
            return
        if tok.logprob is not None:
            seq.cumulative_logprob += tok.logprob
            seq.logprobs.append(self._logprob_dict(token, tok.logprob, tok.rank, tok.top))
        p = seq.params
        is_stop_token = bool(p.stop_token_ids) and token in p.stop_token_ids
        is_eos = not p.ignore_eos and token in self.eos_token_ids
        if (is_stop_token or is_eos) and seq.num_output_tokens >= p.min_tokens:
            if p.include_stop_str_in_output and is_stop_token and self.tokenizer is not None:
                detokenize_incrementally(self.tokenizer, seq)
            seq.finish_reason, seq.stop_reason = "stop", (token if is_stop_token else None)
        else:
            old_len = len(seq.output_text)
            if self.tokenizer is not None:
                detokenize_incrementally(self.tokenizer, seq)
            num_output = len(seq.token_ids) - seq.num_prompt_tokens
            if p.stop_strings and self._check_stop_strings(seq, old_len, num_output >= p.min_tokens):
                pass
            elif seq.at_max_tokens:
                seq.finish_reason = "length"
            elif len(seq.token_ids) >= self.max_model_len:
                seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)

    def _check_stop_strings(self, seq: Sequence, old_len: int, active: bool) -> bool:
        """Feeds the new text to the stop strings' automaton (always, so that its state follows
        the text); before min_tokens (not active) a stop it finds does not count."""
        seq.stop_state, match = seq.params.stop_matcher.advance(seq.stop_state, seq.output_text, old_len)
        if match is None or not active:
            return False
        end = match.end if seq.params.include_stop_str_in_output else match.start
        seq.output_text = seq.output_text[:end]
        seq.finish_reason, seq.stop_reason = "stop", match.stop
        return True

    def _make_output(self, req: _Request) -> RequestOutput:
        """A snapshot of the request: built for every progressing request each step when streaming,
        so it copies only what later steps change (the output token list) and the logprob lists."""
        seqs = req.seqs
        want_logprobs = req.params.logprobs is not None
        outputs = [
            CompletionOutput(s.index, s.output_text, s.token_ids[s.num_prompt_tokens :],
                             s.cumulative_logprob if want_logprobs else None,
                             list(s.logprobs) if want_logprobs else None, s.finish_reason, s.stop_reason)
            for s in seqs
        ]
        first = seqs[0]
        prompt_lps = list(first.prompt_logprobs) if req.params.prompt_logprobs is not None else None
        if len(seqs) == 1:
            finished = first.finish_reason is not None
            first_token_time = first.first_token_time or None
        else:
            finished = all(s.finish_reason is not None for s in seqs)
            first_token_time = min((s.first_token_time for s in seqs if s.first_token_time), default=None)
        metrics = RequestMetrics(req.arrival_time, first_token_time, time.monotonic() if finished else None,
                                 first.num_cached_tokens)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=prompt_lps,
            outputs=outputs,
            finished=finished,
            metrics=metrics,
            num_cached_tokens=first.num_cached_tokens,
        )

    def shutdown(self) -> None:
        self.structured_outputs.shutdown()
        self.executor.shutdown()


def resolve_max_model_len(config: EngineConfig, hf: dict) -> int:
    model_max = hf.get("max_position_embeddings") or 2048
    if config.max_model_len is not None and config.max_model_len > model_max:
        raise InvalidRequestError(
            "max_model_len", f"{config.max_model_len} exceeds the model's max_position_embeddings ({model_max})"
        )
    return config.max_model_len or model_max


def _eos_ids(hf_config: dict, tokenizer) -> set[int]:
    ids: set[int] = set()
    eos = hf_config.get("eos_token_id")
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list):
        ids.update(eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
