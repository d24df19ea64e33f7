"""What both benchmarks share: the run's provenance (device, versions, commit, date, config),
random prompts, a memory-bandwidth probe and the bytes one decode step must read."""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import random
import subprocess
import time
from pathlib import Path

import torch

from qsaserve.config import EngineConfig


def provenance(config: EngineConfig, with_transformers: bool = False) -> dict:
    device = config.torch_device
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "triton": _version("triton"),
        # QSASERVE_COMMIT: set when running from an exported snapshot that has no .git of its own.
        "git_commit": source_commit(),
        "git_dirty": False if os.environ.get("QSASERVE_COMMIT") else bool(_git("status", "--porcelain", "--untracked-files=no")),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": dataclasses.asdict(config),
    }
    if with_transformers:
        info["transformers"] = _version("transformers")
    return info


def source_commit() -> str | None:
    """The commit measured: $QSASERVE_COMMIT (an exported snapshot has no .git) or git's HEAD."""
    return os.environ.get("QSASERVE_COMMIT") or _git("rev-parse", "HEAD")


def kernel_report(bench: str, **fields) -> dict:
    """The head of a GPU kernel benchmark's JSON document: what ran, where, at which commit, when."""
    return {"bench": bench, "device": torch.cuda.get_device_name(), "commit": source_commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__, **fields}


def kernel_bench_main(bench: str, make_rows, configure=None, **fields) -> None:
    """A kernel benchmark's command line (--out FILE): rows = make_rows(cuda device), then the
    document (kernel_report head, fields, rows, wall seconds) printed and written. configure(ap):
    the benchmark's own options, then rows = make_rows(device, args) and the options join the
    document."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    if configure is not None:
        configure(ap)
    args = ap.parse_args()
    start = time.perf_counter()
    if configure is None:
        rows = make_rows(torch.device("cuda"))
    else:
        rows = make_rows(torch.device("cuda"), args)
        fields["options"] = {k: v for k, v in vars(args).items() if k != "out"}
    emit_report(kernel_report(bench, **fields, rows=rows, wall_s=round(time.perf_counter() - start, 1)), args.out)


class TritonCompiles:
    """Counts the Triton kernels built (compiled, or loaded from Triton's disk cache) while the
    recorder is active, by kernel name, with a few of each kernel's specialization keys. A timed
    pass that builds kernels paid for compiles its warm-up did not meet; this names them. It sees
    this process only: under tensor parallelism, rank 0's builds."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.keys: dict[str, list[str]] = {}

    def on_compile(self, *, key, fn, **_) -> None:
        self.counts[fn.name] += 1
        self.keys.setdefault(fn.name, [])
        if len(self.keys[fn.name]) < 3:
            self.keys[fn.name].append(str(key)[:300])

    def report(self) -> dict:
        return {"total": sum(self.counts.values()), "by_kernel": dict(self.counts.most_common()),
                "example_keys": {name: self.keys[name] for name, _ in self.counts.most_common(5)}}


@contextlib.contextmanager
def record_triton_compiles():
    """`with record_triton_compiles() as compiles:` ... `compiles.report()`. Without Triton (or
    on CPU, where nothing is compiled) the count stays 0."""
    compiles = TritonCompiles()
    try:
        from triton import knobs
    except ImportError:
        yield compiles
        return
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = compiles.on_compile
    try:
        yield compiles
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def emit_report(report: dict, out: str | None) -> None:
    """A benchmark's JSON document: printed, and written to `out` when given."""
    text = json.dumps(report, indent=1)
    print(text)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    """Token ids uniform in [0, min(10000, vocab)), as the nano-vllm benchmark draws them."""
    high = min(10000, vocab_size) - 1
    return [rng.randint(0, high) for _ in range(length)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device, nbytes: int | None = None, iters: int = 10) -> dict:
    """Memory bandwidth of this device, measured now: a read-only reduction over a large buffer
    (bytes read / time) and a copy (bytes read + written / time). The roofline uses the larger."""
    if nbytes is None:
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
            nbytes = min(2 << 30, free // 4)
        else:
            nbytes = 64 << 20
    nbytes -= nbytes % 4096
    read_s, copy_s = _time_read_and_copy(device, nbytes, iters)  # its buffers are freed on return
    if device.type == "cuda":
        torch.cuda.empty_cache()
    read, copy = nbytes / read_s / 1e9, 2 * nbytes / copy_s / 1e9
    return {"buffer_bytes": nbytes, "read_gb_s": round(read, 1), "copy_gb_s": round(copy, 1),
            "used_gb_s": round(max(read, copy), 1)}


def _time_read_and_copy(device: torch.device, nbytes: int, iters: int) -> tuple[float, float]:
    """Seconds per read-only reduction and per copy of an nbytes buffer."""
    src = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    words = src.view(torch.float32)

    def timed(fn) -> float:
        fn()
        sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        return (time.perf_counter() - start) / iters

    return timed(lambda: words.sum()), timed(lambda: dst.copy_(src))


def median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def release_memory(device: torch.device) -> None:
    """Frees what a shut-down engine held, so a peer run in the same process has the memory."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
