"""Latency of handing one step's BatchInput from rank 0 to a worker process: the pipe channel
(one node) against the gloo control-group broadcast (several nodes), with
engine/executor/step_channel.py's own classes. Reported: median microseconds from rank 0 starting to send until the worker holds
the unpickled batch (time.perf_counter is one clock for all processes on Linux). CPU only.

    PYTHONPATH=src python benchmarks/bench_step_channel.py [--steps 300] [--out f.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from qsaserve.bench.common import emit_report, source_commit
from qsaserve.engine.batch import BatchInput
from qsaserve.engine.executor.step_channel import GlooBroadcast, PipeReceiver, PipeSender


def decode_batch(rows: int, context: int = 8000, block: int = 16) -> BatchInput:
    table = list(range(context // block + 1))
    return BatchInput([5] * rows, [context] * rows, [context + 7] * rows, [1] * rows, [context + 1] * rows,
                      [table] * rows, list(range(rows)), list(range(1, rows + 1)))


def _pipe_worker(read_fd: int, reply) -> None:
    steps = PipeReceiver(read_fd)
    while (batch := steps.recv()) is not None:
        reply.put((time.perf_counter(), len(batch.input_ids)))


def pipe_latency(batch: BatchInput, steps: int) -> list[float]:
    ctx = mp.get_context("fork")  # the worker inherits the pipe fd
    reply = ctx.Queue()
    read_fd, write_fd = os.pipe()
    proc = ctx.Process(target=_pipe_worker, args=(read_fd, reply))
    proc.start()
    os.close(read_fd)
    sender = PipeSender([write_fd])
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        sender.send(batch)
        got, _ = reply.get()
        out.append(got - start)
        time.sleep(0.002)  # the worker is back in its blocking read, as between real steps
    sender.send(None)
    sender.close()
    proc.join()
    return out


def _gloo_rank(rank: int, port: int, batch: BatchInput, steps: int, reply) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    channel = GlooBroadcast(dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=5)))
    for _ in range(steps):
        if rank == 0:
            reply.put(("sent", time.perf_counter()))
            channel.send(batch)
            time.sleep(0.002)
        else:
            channel.recv()
            reply.put(("got", time.perf_counter()))
    dist.destroy_process_group()


def gloo_latency(batch: BatchInput, steps: int) -> list[float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("fork")
    reply = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, batch, steps, reply)) for r in (0, 1)]
    for p in procs:
        p.start()
    sent, got = [], []
    for _ in range(2 * steps):
        kind, t = reply.get()
        (sent if kind == "sent" else got).append(t)
    for p in procs:
        p.join()
    return [g - s for s, g in zip(sent, got)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        batch = decode_batch(rows)
        for name, fn in (("pipe", pipe_latency), ("gloo_broadcast", gloo_latency)):
            lat = fn(batch, args.steps)[20:]  # the first sends warm up connections and allocators
            row = {"channel": name, "rows": rows, "median_us": round(1e6 * statistics.median(lat), 1),
                   "p90_us": round(1e6 * sorted(lat)[int(0.9 * len(lat))], 1)}
            print(json.dumps(row), flush=True)
            results.append(row)
    report = {"bench": "step_channel", "commit": source_commit(), "machine": platform.machine(), "cpus": os.cpu_count(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": args.steps, "results": results}
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
