"""Per-step figures of a torch.profiler run: device time and launches, the top kernels, the
collectives by their position in the step, the device's busy span and idle time, the top host
ops. What bench/step_profile.py reports for rank 0 and what a worker rank reports about its own
steps (engine/executor/worker.py). Also the per-layer ranges of a profile (layer_ranges,
summarize_layers)."""
from __future__ import annotations

import collections
import contextlib
import statistics

import torch


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


LAYER_RANGE_PREFIX = "qsaserve.layer:"


@contextlib.contextmanager
def layer_ranges(layers: list[tuple[str, torch.nn.Module]]):
    """While active, each decoder layer's forward runs inside a torch.profiler range named
    "qsaserve.layer:<index>:<kind>", so a profile attributes the kernels it launched (and its
    host time) to it. Forward hooks, not edits of the model: any model that names its layers
    (models.interfaces.SupportsLayerProfile) can be profiled; eager steps only (a graph replay
    runs no Python)."""
    handles, open_ranges = [], {}

    def enter(i, kind):
        def hook(module, args):
            r = torch.profiler.record_function(f"{LAYER_RANGE_PREFIX}{i}:{kind}")
            r.__enter__()
            open_ranges[i] = r
        return hook

    def leave(i):
        def hook(module, args, output):
            open_ranges.pop(i).__exit__(None, None, None)
        return hook

    for i, (kind, module) in enumerate(layers):
        handles.append(module.register_forward_pre_hook(enter(i, kind)))
        handles.append(module.register_forward_hook(leave(i)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for r in open_ranges.values():  # a forward that raised inside a layer
            r.__exit__(None, None, None)


def summarize_layers(events, steps: int) -> dict:
    """Per layer kind, from the "qsaserve.layer:" ranges of a profile over `steps` steps: layers
    of the kind, and per layer per step the device time of the kernels it launched and its host
    time (ms, means over the kind's layers). Device time: the range's kernels, launched inside
    it, wherever they ran on the stream; host time: the range's wall time on the CPU."""
    by_kind: dict[str, dict] = {}
    for e in events:
        if not e.name.startswith(LAYER_RANGE_PREFIX) or getattr(e, "device_type", None) != torch.autograd.DeviceType.CPU:
            # The range's device-side twin (a user annotation on the GPU timeline) spans from its
            # first kernel's start to its last kernel's end, idle gaps included: in an eager step
            # that is the host's launch time. The host-side range sums its ops' kernels instead.
            continue
        _, index, kind = e.name.split(":")
        k = by_kind.setdefault(kind, {"layers": set(), "device_us": 0.0, "host_us": 0.0})
        k["layers"].add(int(index))
        k["device_us"] += _device_time_us(e)
        k["host_us"] += e.cpu_time_total
    out = {}
    for kind, k in sorted(by_kind.items()):
        n = len(k["layers"]) * steps
        out[kind] = {"layers": len(k["layers"]), "device_ms_per_layer": round(k["device_us"] / n / 1e3, 4),
                     "host_ms_per_layer": round(k["host_us"] / n / 1e3, 4)}
    return out


def _device_time_us(event) -> float:
    """Device time of the kernels launched inside a profiler range (torch renamed cuda_* to device_*)."""
    total = getattr(event, "device_time_total", None)
    return float(total if total is not None else getattr(event, "cuda_time_total", 0.0))
