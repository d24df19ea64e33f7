"""Where a prefill's time goes: one engine step that prefills B prompts of N tokens, profiled
with torch.profiler (host ops and CUDA kernels), after a warm-up pass of the same shape. Prints
JSON per case: wall ms, device ms, kernel launches, device idle inside the step, the top kernels
and host ops (engine.profiling.summarize_events), and how many blocking syncs the host made.

    PYTHONPATH=src python benchmarks/profile_prefill.py qwen4exp-small --cases 1x1024,1x8192,16x1024
    PYTHONPATH=src python benchmarks/profile_prefill.py llama-8b --max-model-len 4096 --cases 1x1024 --quantization fp8
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from qsaserve.bench.common import random_prompt
from qsaserve.config import EngineConfig
from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.engine.profiling import summarize_events
from qsaserve.sampling_params import SamplingParams

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync", "cudaMemcpy")


def prefill_once(engine: LLMEngine, batch: int, length: int, rng: random.Random, tag: str) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    start = time.perf_counter()
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": random_prompt(rng, length, engine.vocab_size)}, params)
    while any(rid in engine.requests for rid in ids):
        engine.step(outputs="finished")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--cases", default="1x1024,1x8192")
    ap.add_argument("--max-model-len", type=int, default=9000)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--quantization", default=None, help="the engine's --quantization (fp8, nvfp4)")
    args = ap.parse_args()
    extra = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
    config = EngineConfig(model=args.model, load_format="dummy", max_model_len=args.max_model_len,
                          quantization=args.quantization, **extra)
    engine = LLMEngine(config, progress=False)
    rng = random.Random(0)
    rows = []
    try:
        for case in args.cases.split(","):
            batch, length = (int(v) for v in case.split("x"))
            first = prefill_once(engine, batch, length, rng, f"cold-{case}")
            warm = [prefill_once(engine, batch, length, rng, f"warm-{case}-{i}") for i in range(2)]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                profiled = prefill_once(engine, batch, length, rng, f"prof-{case}")
            events = prof.events()
            summary = summarize_events(events, 1, top=args.top)
            syncs = {}
            for e in events:
                if e.name in SYNC_OPS:
                    syncs[e.name] = syncs.get(e.name, 0) + 1
            row = {"case": case, "first_ms": round(first * 1e3, 1), "warm_ms": [round(w * 1e3, 1) for w in warm],
                   "profiled_ms": round(profiled * 1e3, 1), "sync_calls": syncs, **summary}
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        engine.shutdown()
    print(json.dumps({"bench": "profile_prefill", "model": args.model, "quantization": args.quantization, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                      "rows": rows}))


if __name__ == "__main__":
    main()
