"""The same parallel engine built several times in one process: batch-1 decode step time at one
context for each build. A diagnostic for engines built one after another in one process (the
qualify harness does this): with tensor parallelism, a second engine once ran ~0.2 ms per step
slower than the first on 2 H200s (dcp_order_diag_qwen4exp_small_1kv_h200x2_2026-11-30_8368588.json).

    python benchmarks/bench_engine_restart.py --builds 2 --context 8192 --async-scheduling
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import threading
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_dcp import profile_at, timed_request  # noqa: E402

from qsaserve import LLM  # noqa: E402
from qsaserve.bench.common import source_commit  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen4exp-small-1kv")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dcp", type=int, default=1)
    p.add_argument("--builds", type=int, default=2)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--async-scheduling", action="store_true")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="also a step breakdown per build (wall, executor, rank 0's CUDA kernels); 0: off")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    report = {"benchmark": "engine rebuilt in one process", "commit": source_commit(), "preset": args.preset,
              "tensor_parallel_size": args.tp, "decode_context_parallel_size": args.dcp, "context": args.context,
              "async_scheduling": args.async_scheduling, "builds": []}
    for n in range(args.builds):
        t0 = time.perf_counter()
        llm = LLM(args.preset, load_format="dummy", progress=False, tensor_parallel_size=args.tp,
                  decode_context_parallel_size=args.dcp, max_model_len=args.context + 256, kv_cache_memory=8 << 30,
                  max_num_batched_tokens=8192, max_num_seqs=4, seed=0, ple_placement="gpu",
                  async_scheduling=args.async_scheduling)
        eng = llm.engine
        startup = time.perf_counter() - t0
        vocab = eng.vocab_size
        timed_request(eng, min(512, args.context // 2), 8, vocab, seed=99)  # warm-up
        runs = [timed_request(eng, args.context - args.decode_tokens, args.decode_tokens, vocab, seed=args.context + k)
                for k in range(2)]
        prof = profile_at(eng, args.context - 4 * args.profile_steps, args.profile_steps, vocab) if args.profile_steps else None
        t1 = time.perf_counter()
        eng.shutdown()
        row = {"build": n, "startup_s": round(startup, 1), "shutdown_s": round(time.perf_counter() - t1, 2),
               "decode_step_ms": [round(r["decode_step_ms"], 4) for r in runs],
               # What the process still runs after the engine is gone (a leftover thread would show here).
               "threads_after_shutdown": sorted(t.name for t in threading.enumerate())}
        if prof is not None:
            row["step_profile"] = prof
        report["builds"].append(row)
        print(json.dumps(row), flush=True)
        del llm, eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    report["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(report, fh, indent=1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
