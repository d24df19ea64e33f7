"""Where a decode step's time goes: wall time, the executor's share (device work included), and
the CUDA kernels this process ran, for steps of requests that are already decoding.

The answer to "why is batch-1 decode slower than the roofline": if the kernels' device time per
step is far below the wall time, the step is host-bound (scheduling, input staging, worker
messages, sampling); if close, the named top kernels are where to look. Under tensor or decode
context parallelism it profiles rank 0 (the engine's own process)."""
from __future__ import annotations

import collections
import statistics
import tempfile
import time

import torch

from qsaserve.engine.llm_engine import LLMEngine


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
    """Time `steps` engine steps, then profile `steps` more; every running request must have at
    least 2 * steps tokens left to decode. Returns JSON-ready figures (milliseconds per step)."""
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
    if not cuda:
        return report
    try:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
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
    except Exception as e:  # profiler unavailable (CUPTI missing): keep the timings
        report["profiler_error"] = repr(e)[:300]
    return report


def summarize_events(events, steps: int, top: int = 15) -> dict:
    """Per-step figures of a torch.profiler run over `steps` steps: device time and launches, the
    top kernels, the device's span and idle time, the top host ops. Also what a worker rank
    reports about its own steps (MultiprocExecutor.profile_workers)."""
    # Aggregated from the events themselves, by kind: with CPU activity on, key_averages() also
    # credits kernel time to the host ops that launched it.
    device_time, device_calls = collections.Counter(), collections.Counter()
    host_time, host_calls = collections.Counter(), collections.Counter()
    intervals = []
    for e in events:
        if _is_device_event(e):
            device_time[e.name] += e.time_range.elapsed_us()
            device_calls[e.name] += 1
            intervals.append((e.time_range.start, e.time_range.end))
        elif e.self_cpu_time_total > 0:
            host_time[e.name] += e.self_cpu_time_total
            host_calls[e.name] += 1
    kernels = sorted(((us, device_calls[name], name) for name, us in device_time.items() if us > 0), reverse=True)
    host_ops = sorted(((us, host_calls[name], name) for name, us in host_time.items()), reverse=True)
    out = {"device_ms": round(sum(k[0] for k in kernels) / steps / 1e3, 3),
           "kernel_launches_per_step": round(sum(k[1] for k in kernels) / steps, 1),
           # Collectives spin inside their kernel until every peer has arrived: a rank that waits
           # for a slower peer shows it here.
           "nccl_ms": round(sum(k[0] for k in kernels if "nccl" in k[2].lower()) / steps / 1e3, 3),
           "top_kernels": [{"name": name[:120], "ms_per_step": round(us / steps / 1e3, 4),
                            "calls_per_step": round(n / steps, 2)} for us, n, name in kernels[:top]]}
    # From the first kernel's start to the last one's end, per step, and how much of that no
    # kernel ran: idle device time inside a run of steps is time the host (or a peer rank this
    # one waits for outside a kernel) kept the device waiting. Host tracing adds its own cost, so
    # the idle time is an upper bound; host ops include blocking waits (cudaStreamSynchronize, a
    # readback's memcpy, an event wait).
    out["nccl_by_position"] = collective_positions(
        [(e.time_range.start, e.time_range.elapsed_us(), e.name) for e in events
         if _is_device_event(e) and "nccl" in e.name.lower()], steps)
    busy, span = busy_and_span(intervals)
    out["device_span_ms"] = round(span / steps / 1e3, 3)
    out["device_idle_ms"] = round((span - busy) / steps / 1e3, 3)
    out["top_host_ops"] = [{"name": name[:120], "ms_per_step": round(us / steps / 1e3, 4),
                            "calls_per_step": round(n / steps, 2)} for us, n, name in host_ops[:top]]
    return out


def collective_positions(calls: list[tuple[float, float, str]], steps: int) -> list[list] | None:
    """(start, microseconds, kernel name) of every collective kernel over `steps` steps -> for each
    position in a step's sequence of collectives, its kind and median microseconds across the
    steps: where in the step a rank waits for its peer. None when steps issued different counts."""
    if not calls or len(calls) % steps:
        return None
    per_step = len(calls) // steps
    ordered = sorted(calls)
    out = []
    for i in range(per_step):
        name = ordered[i][2]
        kind = name.split("(")[0].split("_")[1] if name.startswith("ncclDevKernel_") else name[:40]
        out.append([kind, round(statistics.median(ordered[s * per_step + i][1] for s in range(steps)), 1)])
    return out


def _is_device_event(event) -> bool:
    """A kernel, memcpy or memset on the device; not a GPU-side user annotation (e.g. an NCCL
    range), which spans kernels that are counted themselves."""
    device_type = getattr(event, "device_type", None)
    return (device_type is not None and device_type != torch.autograd.DeviceType.CPU
            and not getattr(event, "is_user_annotation", False))


def busy_and_span(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(time covered by at least one interval, first start to last end) of (start, end) pairs."""
    if not intervals:
        return 0.0, 0.0
    ordered = sorted(intervals)
    busy, cur_start, cur_end = 0.0, *ordered[0]
    for start, end in ordered[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy, max(end for _, end in ordered) - ordered[0][0]


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
