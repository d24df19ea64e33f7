"""Timing of one GPU call for the kernel benchmarks (benchmarks/bench_*.py), in one place.

- `event_ms`: CUDA events around back-to-back calls (the caches stay warm between calls).
- `graph_ms`: the call captured once in a CUDA graph and replayed, timed with `event_ms`
  (launch overhead removed, as in a decode step).
- `do_bench_s` / `do_bench_graph_s`: triton's do_bench (L2 flushed before each call) and
  do_bench_cudagraph, medians in seconds.
"""
from __future__ import annotations

import statistics

import torch


def event_ms(fn, iters: int = 30, repeats: int = 5) -> float:
    """Median over `repeats` of the mean time of `iters` back-to-back calls (CUDA events)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / iters)
    return statistics.median(out)


def graph_ms(fn) -> float:
    """fn captured in a CUDA graph (after one warm-up call on a side stream) and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return event_ms(graph.replay)


def do_bench_s(fn, warmup: int = 20, rep: int = 80) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e-3


def do_bench_graph_s(fn, rep: int = 50) -> float:
    from triton.testing import do_bench_cudagraph

    fn()
    return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e-3


__all__ = ["do_bench_graph_s", "do_bench_s", "event_ms", "graph_ms"]
