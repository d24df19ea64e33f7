"""AsyncLLMEngine: drives an LLMEngine from one background thread for asyncio servers.

LLMEngine is not thread-safe, so every call into it (adding, aborting, stepping) runs on the
loop thread; asyncio code submits commands and awaits their futures. Outputs are cumulative,
so each request keeps only its newest output: a slow consumer skips intermediate ones instead
of growing a queue. A consumer that stops iterating (client disconnect, task cancelled) aborts
its request, which frees its KV blocks on the next loop iteration.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol, Sequence

from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.errors import EngineDeadError, InvalidRequestError
from qsaserve.outputs import RequestOutput
from qsaserve.sampling_params import SamplingParams

logger = logging.getLogger("qsaserve")


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting; the caller should retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class RequestObserver(Protocol):
    """Timing hooks, called on the engine thread (the server's metrics implement them)."""

    def on_first_token(self, seconds: float) -> None: ...

    def on_inter_token(self, seconds: float) -> None: ...

    def on_finished(self, output: RequestOutput, e2e_seconds: float) -> None: ...


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine gauges and counters, rebuilt by the engine thread after each step so other threads
    read a consistent set without touching the engine."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Hybrid models: recurrent-state snapshots of the prefix cache (engine/state_cache.py).
    prefix_state_hits: int = 0
    prefix_state_misses: int = 0
    prefix_state_snapshots: int = 0
    prefix_state_snapshot_bytes: int = 0
    # The host-memory tier of the prefix cache (engine/host_kv_tier.py, --kv-offload-gib).
    host_tier_hits: int = 0
    host_tier_blocks_offloaded: int = 0
    host_tier_blocks_restored: int = 0
    host_tier_snapshots_offloaded: int = 0
    host_tier_snapshots_restored: int = 0
    host_tier_bytes_used: int = 0
    host_tier_bytes: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_unfinished_requests: int = 0
    # Speculative decoding (engine/spec_decode.py): draft tokens verified / accepted, verifies (one
    # sequence's drafts in one step), and per draft position the verifies that accepted it.
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_verifies: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # Steps the automatic fallback let sequences draft in / kept them from it (draft_policy.py).
    spec_drafting_steps: int = 0
    spec_fallback_steps: int = 0
    spec_retired: int = 0  # sequences the fallback stopped from drafting for good


def _spec_counters(spec) -> dict:
    if spec is None:
        return {}
    st = spec.stats
    return dict(spec_drafted=st.drafted, spec_accepted=st.accepted, spec_verifies=st.verifies,
                spec_accepted_per_position=tuple(st.accepted_per_position), spec_drafting_steps=st.drafting_steps,
                spec_fallback_steps=st.fallback_steps, spec_retired=st.retired)


def _state_cache_counters(cache) -> dict:
    if cache is None:
        return {}
    return dict(prefix_state_hits=cache.stats.hits, prefix_state_misses=cache.stats.misses,
                prefix_state_snapshots=cache.num_cached, prefix_state_snapshot_bytes=cache.nbytes)


def _host_tier_counters(tier) -> dict:
    if tier is None:
        return {}
    st = tier.stats
    return dict(host_tier_hits=st.hits, host_tier_blocks_offloaded=st.blocks_offloaded,
                host_tier_blocks_restored=st.blocks_restored, host_tier_snapshots_offloaded=st.snapshots_offloaded,
                host_tier_snapshots_restored=st.snapshots_restored, host_tier_bytes_used=tier.bytes_used,
                host_tier_bytes=tier.nbytes)


class RequestStream:
    """Async iterator over one request's cumulative outputs; ends after the finished output."""

    def __init__(self, request_id: str, engine: "AsyncLLMEngine", loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._engine = engine
        self.loop = loop
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self._done = False  # finished, failed or aborted: nothing more to read

    # Called on the event loop (scheduled there by the engine thread).
    def _put(self, output: RequestOutput) -> None:
        self._latest = output
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        while self._latest is None and self._error is None:
            await self._event.wait()
            self._event.clear()
        if self._latest is not None:
            out, self._latest = self._latest, None
            if out.finished:
                self._done = True
            return out
        self._done = True
        raise self._error

    @property
    def finished(self) -> bool:
        return self._done

    def fail(self, error: BaseException) -> None:
        """Ends the stream with `error` (raised to its reader after any output already delivered)
        and stops the request. Call on the stream's event loop."""
        if not self._done:
            self._fail(error)
            self._engine._post_abort(self.request_id)

    def abort(self) -> None:
        """Stops the request if it is still running (idempotent)."""
        if not self._done:
            self._done = True
            self._engine._post_abort(self.request_id)


class AsyncLLMEngine:
    """max_waiting_requests bounds the sequences waiting to be scheduled (a request with n
    completions counts n), max_waiting_tokens the prompt tokens they still have to compute; an
    add beyond either raises EngineOverloadedError, and one that could never fit
    InvalidRequestError."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_waiting_requests: int | None = None,
        max_waiting_tokens: int | None = None,
        retry_after: int = 1,
        start: bool = True,
    ):
        for name, value in (("max_waiting_requests", max_waiting_requests), ("max_waiting_tokens", max_waiting_tokens)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidRequestError(name, f"must be an integer >= 1, got {value!r}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.max_waiting_tokens = max_waiting_tokens
        self.retry_after = retry_after
        self.observers: list[RequestObserver] = []
        self.snapshot = EngineSnapshot()
        self._commands: deque[tuple[Callable[[], object], concurrent.futures.Future | None]] = deque()
        self._lock = threading.Lock()  # orders command submission against the thread's death
        self._wake = threading.Event()
        self._stopping = False
        self._dead: EngineDeadError | None = None
        # Owned by the engine thread.
        self._streams: dict[str, RequestStream] = {}
        self._timing: dict[str, list[float]] = {}  # request_id -> [arrival, last_token_time, tokens_seen]
        self._thread = threading.Thread(target=self._run, name="qsaserve-engine", daemon=True)
        self._update_snapshot()
        if start:
            self.start()

    # ---- lifecycle ----
    def start(self) -> None:
        if not self._thread.is_alive() and self._dead is None:
            self._thread.start()

    def is_healthy(self) -> bool:
        return self.dead_error is None and self._thread.is_alive() and not self._stopping

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine stopped serving (None while healthy). Also asks the executor, so a
        worker rank that died while the engine was idle shows up before the next step."""
        if self._dead is None and self._thread.ident is not None and not self._thread.is_alive():
            return EngineDeadError("the engine loop thread is not running")
        if self._dead is None:
            try:
                self.engine.executor.check_health()
            except EngineDeadError as e:
                return e
        return self._dead

    def shutdown(self, timeout: float = 30.0, shutdown_engine: bool = True) -> None:
        """Stops the loop thread after its current step; unfinished requests end with EngineDeadError."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %.0f s; it stops after its current step", timeout)
                return
        elif self._thread.ident is None:  # never started: nothing else touches the engine
            self._die(EngineDeadError("the engine was shut down"))
        if shutdown_engine:
            self.engine.shutdown()

    # ---- requests ----
    async def add_request(self, request_id: str, prompt, params: SamplingParams) -> RequestStream:
        return (await self.add_requests([(request_id, prompt, params)]))[0]

    async def add_requests(self, requests: Sequence[tuple[str, object, SamplingParams]]) -> list[RequestStream]:
        """Adds all requests or none. Raises InvalidRequestError (bad input), EngineOverloadedError
        (the waiting queue is full) or EngineDeadError."""
        loop = asyncio.get_running_loop()
        streams = [RequestStream(rid, self, loop) for rid, _, _ in requests]
        arrival = time.monotonic()

        def add() -> None:
            waiting = self._waiting_load()
            # Checked before anything is added, with the token counts known so far (prompts given
            # as ids), and again after tokenizing any text prompts.
            self._check_capacity(waiting, [(params.n, _known_prompt_tokens(prompt)) for _, prompt, params in requests])
            added: list[str] = []
            try:
                for (rid, prompt, params), stream in zip(requests, streams):
                    if rid in self._streams:
                        raise InvalidRequestError("request_id", f"{rid!r} is already in use")
                    self.engine.add_request(rid, prompt, params)
                    added.append(rid)
                    self._streams[rid] = stream
                    self._timing[rid] = [arrival, arrival, 0]
                if any(_known_prompt_tokens(prompt) is None for _, prompt, _ in requests):
                    self._check_capacity(waiting, [(self.engine.requests[rid].params.n,
                                                    len(self.engine.requests[rid].prompt_token_ids)) for rid in added])
            except BaseException:
                for rid in added:
                    self._drop(rid)
                raise

        future = self._submit(add)
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The add may already have run; the aborts queue behind it, so they find the requests.
            for rid, _, _ in requests:
                self._post_abort(rid)
            raise
        return streams

    async def generate(self, request_id: str, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yields cumulative outputs until the request finishes; closing or cancelling the
        iterator early aborts the request."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self._submit(lambda: self._drop(request_id)))

    async def run(self, fn: Callable[[LLMEngine], object]):
        """Runs fn(engine) on the engine thread between steps and returns its result."""
        return await asyncio.wrap_future(self._submit(lambda: fn(self.engine)))

    # ---- engine-thread side ----
    def _waiting_load(self) -> tuple[int, int]:
        """(sequences waiting to be scheduled, tokens they have yet to compute)."""
        waiting = self.engine.scheduler.waiting
        if self.max_waiting_tokens is None:
            return len(waiting), 0
        return len(waiting), sum(seq.num_tokens - seq.num_computed_tokens for seq in waiting)

    def _check_capacity(self, waiting: tuple[int, int], incoming: list[tuple[int, int | None]]) -> None:
        """incoming: (n, prompt tokens or None if not known yet) per request."""
        seqs = sum(n for n, _ in incoming)
        tokens = sum(n * (t or 0) for n, t in incoming)
        for limit, now, more, param, unit in (
            (self.max_waiting_requests, waiting[0], seqs, "n", "sequences (n per prompt)"),
            (self.max_waiting_tokens, waiting[1], tokens, "prompt", "prompt tokens (times n)"),
        ):
            if limit is None:
                continue
            if more > limit:
                raise InvalidRequestError(param, f"the request needs {more} waiting {unit}; at most {limit} may wait")
            if now + more > limit:
                raise EngineOverloadedError(
                    f"the server is overloaded: {now} {unit.split(' (')[0]} are waiting and this request adds {more} "
                    f"(limit {limit}); retry later", self.retry_after,
                )

    def _submit(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            dead = self.dead_error
            if dead is None and self._stopping:
                dead = EngineDeadError("the engine is shutting down")
            if dead is not None:
                future.set_exception(dead)
                return future
            self._commands.append((fn, future))
        self._wake.set()
        return future

    def _post_abort(self, request_id: str) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._commands.append((lambda: self._drop(request_id), None))
        self._wake.set()

    def _drop(self, request_id: str) -> None:
        """Aborts a request in the engine (freeing its blocks) without publishing anything."""
        self.engine.abort_request(request_id)
        self._streams.pop(request_id, None)
        self._timing.pop(request_id, None)

    def _run(self) -> None:
        try:
            while True:
                self._run_commands()
                if self._stopping:
                    break
                if not self.engine.has_unfinished_requests():
                    self._update_snapshot()
                    self._wake.wait()
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                self._publish(outputs)
                self._update_snapshot()
                if not outputs:
                    time.sleep(0.001)  # nothing could be scheduled: do not spin on the GIL
        except BaseException as e:  # noqa: BLE001 - any failure here ends the engine
            logger.exception("engine loop died")
            self._die(EngineDeadError(f"the engine loop died: {type(e).__name__}: {e}"))
            return
        self._die(EngineDeadError("the engine was shut down"))

    def _run_commands(self) -> None:
        while self._commands:
            fn, future = self._commands.popleft()
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            if future is None:
                fn()  # an abort: if freeing a request fails, the engine's state is broken; die
                continue
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - the caller gets it; adds validate before mutating
                future.set_exception(e)
            else:
                future.set_result(result)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            self._observe(out, now)
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(stream.loop, []).append((stream, out))
        for loop, items in batches.items():
            _call_soon(loop, _deliver, items)

    def _observe(self, out: RequestOutput, now: float) -> None:
        timing = self._timing.get(out.request_id)
        if timing is None:
            return
        tokens = sum(len(c.token_ids) for c in out.outputs)
        if tokens > timing[2]:
            for obs in self.observers:
                if timing[2] == 0:
                    obs.on_first_token(now - timing[0])
                else:
                    obs.on_inter_token(now - timing[1])
            timing[1], timing[2] = now, tokens
        if out.finished:
            del self._timing[out.request_id]
            for obs in self.observers:
                obs.on_finished(out, now - timing[0])

    def _update_snapshot(self) -> None:
        e = self.engine
        bm = e.block_manager
        self.snapshot = EngineSnapshot(
            num_requests_running=len({s.request_id for s in e.scheduler.running}),
            num_requests_waiting=len({s.request_id for s in e.scheduler.waiting}),
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.stats.queries,
            prefix_cache_hits=bm.stats.hits,
            **_state_cache_counters(bm.state_cache),
            **_host_tier_counters(bm.host_tier),
            **_spec_counters(e.spec),
            num_preemptions=e.scheduler.num_preemptions,
            prompt_tokens=e.stats["prompt_tokens"],
            generation_tokens=e.stats["generation_tokens"],
            num_unfinished_requests=len(e.requests),
        )

    def _die(self, error: EngineDeadError) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = error
            pending = list(self._commands)
            self._commands.clear()
        for _, future in pending:
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(error)
        streams = list(self._streams.values())
        self._streams.clear()
        self._timing.clear()
        for stream in streams:
            _call_soon(stream.loop, stream._fail, error)
        # Best effort: free what the dead engine still holds, so its state can be inspected.
        try:
            for rid in list(self.engine.requests):
                self.engine.abort_request(rid)
            self._update_snapshot()
        except Exception:  # noqa: BLE001 - the engine is already broken
            logger.exception("could not release the requests of the dead engine")


def _known_prompt_tokens(prompt) -> int | None:
    """A prompt's token count when it is given as token ids (None for text, not tokenized yet)."""
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), (list, tuple)):
        return len(prompt["prompt_token_ids"])
    if isinstance(prompt, (list, tuple)):
        return len(prompt)
    return None


def _deliver(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream._put(out)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
        pass
