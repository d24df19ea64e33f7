"""Where a decode step's time goes: wall time, the executor's share (device work included), and
the CUDA kernels this process ran, for steps of requests that are already decoding.

The answer to "why is batch-1 decode slower than the roofline": if the kernels' device time per
step is far below the wall time, the step is host-bound (scheduling, input staging, worker
messages, sampling); if close, the named top kernels are where to look. Under tensor or decode
context parallelism it profiles rank 0 (the engine's own process); the per-layer ranges need
one rank."""
from __future__ import annotations

import statistics
import tempfile
import time

import torch

from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.engine.profiling import summarize_events, summarize_layers


class ExecuteTimer:
    """While active, times every executor.execute call to its end on the device (a synchronize
    after it; the sampler's readback syncs right after anyway) and hands (batch, seconds) to
    `on_execute`."""

    def __init__(self, executor, on_execute):
        self.executor, self.on_execute = executor, on_execute
        self.cuda = executor.device.type == "cuda"

    def __enter__(self):
        execute = self.executor.execute

        def timed_execute(batch, *args, **kwargs):
            start = time.perf_counter()
            out = execute(batch, *args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize()
            self.on_execute(batch, time.perf_counter() - start)
            return out

        self.executor.execute = timed_execute  # an instance attribute shadows the method until deleted
        return self

    def __exit__(self, *exc):
        del self.executor.execute


def profile_decode_steps(engine: LLMEngine, steps: int = 16, top: int = 15) -> dict:
    """Time `steps` engine steps, profile `steps` more, then `steps` more eagerly with each
    decoder layer in a profiler range (`layers`: per layer kind, device and host ms per layer; on
    CPU host only); every running request must have at least 3 * steps tokens left to decode.
    Returns JSON-ready figures (milliseconds per step)."""
    if steps < 1:
        raise ValueError(f"steps: must be >= 1, got {steps}")
    executor = engine.executor
    cuda = executor.device.type == "cuda"
    spent = [0.0]
    walls, executes = [], []
    with ExecuteTimer(executor, lambda batch, seconds: spent.__setitem__(0, spent[0] + seconds)):
        for _ in range(steps):
            spent[0] = 0.0
            start = time.perf_counter()
            engine.step(outputs="finished")
            walls.append(time.perf_counter() - start)
            executes.append(spent[0])
    report = {"steps": steps, "batch": len(engine.scheduler.running),
              "wall_ms": round(1e3 * statistics.median(walls), 3),
              "execute_ms": round(1e3 * statistics.median(executes), 3),
              "outside_execute_ms": round(1e3 * statistics.median(w - e for w, e in zip(walls, executes)), 3),
              "cuda_graphs": executor.cuda_graphs}
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    try:
        if cuda:
            with tempfile.TemporaryDirectory() as worker_dir:
                executor.profile_workers("start", worker_dir)  # tensor/decode-context parallel: the other ranks too
                try:
                    with torch.profiler.profile(activities=activities) as prof:
                        for _ in range(steps):
                            engine.step(outputs="finished")
                        torch.cuda.synchronize()
                    report.update(summarize_events(prof.events(), steps, top))
                finally:  # a started worker profiler records until told to stop
                    workers = executor.profile_workers("stop", worker_dir, steps=steps, top=top)
                    if workers is not None:
                        report["worker_ranks"] = workers
        report.update(_layer_profile(engine, steps, activities))
    except Exception as e:  # profiler unavailable (CUPTI missing): keep the timings
        report["profiler_error"] = repr(e)[:300]
    return report


def _layer_profile(engine: LLMEngine, steps: int, activities) -> dict:
    """`steps` eager steps with every decoder layer in a profiler range (executor.layer_profile):
    {"layers": per kind, "layer_profile_wall_ms": the eager step's wall time}; {} when the model
    does not name its layers. Eager because a graph replay runs no Python: the layers' device time
    is the same kernels a replay runs, their host time is what the graph saves."""
    cuda = engine.executor.device.type == "cuda"
    with engine.executor.layer_profile() as kinds:
        if kinds is None:
            return {}
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step(outputs="finished")
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
    return {"layers": summarize_layers(prof.events(), steps), "layer_profile_wall_ms": round(1e3 * wall / steps, 3)}


class StepBreakdown:
    """Every engine step of a run, split into decode-only steps and steps with prompt tokens:
    count, wall seconds, the executor's seconds (device work included), the rest (scheduling,
    staging, sampling, outputs), and the mean rows per step. Where a throughput run's time goes."""

    def __init__(self):
        self.kinds = {"decode": [0, 0.0, 0.0, 0], "with_prompt": [0, 0.0, 0.0, 0]}  # steps, wall, execute, rows
        self._execute = 0.0
        self._kind = None
        self._rows = 0

    def on_execute(self, batch, seconds: float) -> None:
        self._execute += seconds
        self._kind = "decode" if all(n == 1 for n in batch.query_lens) else "with_prompt"
        self._rows = len(batch.query_lens)

    def step(self, engine: LLMEngine) -> None:
        self._execute, self._kind = 0.0, None
        start = time.perf_counter()
        engine.step(outputs="finished")
        wall = time.perf_counter() - start
        if self._kind is not None:
            k = self.kinds[self._kind]
            k[0] += 1
            k[1] += wall
            k[2] += self._execute
            k[3] += self._rows

    def report(self) -> dict:
        out = {}
        for kind, (n, wall, execute, rows) in self.kinds.items():
            out[kind] = {"steps": n, "wall_s": round(wall, 3), "execute_s": round(execute, 3),
                         "outside_execute_s": round(wall - execute, 3),
                         "ms_per_step": round(1e3 * wall / n, 3) if n else None,
                         "mean_rows": round(rows / n, 1) if n else None}
        return out
