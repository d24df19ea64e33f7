"""Host (Python) work per engine step at a large decode batch, with the model's time taken out.

The nano-vllm throughput workload's shape (N concurrent requests, prompts and outputs uniform in
[min_len, max_len] token ids, ignore_eos) on a model small enough that its forward pass is cheap:
by default a tiny random Llama written to a temporary directory (load_format="dummy"), on CPU.
Once every request is decoding, each timed step is split into the model's forward pass and LM
head (on CUDA followed by a synchronize so their device time lands there) and everything else
(scheduling, block tables, batch building, input staging, sampling, outputs): the host overhead. The
same steps are then timed again under cProfile (paused inside `execute`, so it sees host work
only), whose top entries are reported. On CPU the sampler's tensor operations count as host work;
on a GPU they are kernel launches. Prints JSON.

    PYTHONPATH=src python benchmarks/host_overhead.py                       # CPU, tiny Llama
    PYTHONPATH=src python benchmarks/host_overhead.py --model llama-1b --device cuda --max-model-len 4096
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from qsaserve.config import EngineConfig
from qsaserve.engine.llm_engine import LLMEngine
from qsaserve.sampling_params import SamplingParams

TINY_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=1000, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                  max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)


class ModelTimer:
    """Wraps the model's own work, accumulating its seconds (device work included): the eager
    runner's forward pass and LM head, or with CUDA graphs the whole executor call (whose input
    staging then counts as model time). While `profiler` is set, it is paused inside, so the
    profile holds host work only."""

    def __init__(self, engine: LLMEngine):
        self.seconds, self.profiler = 0.0, None
        self.cuda = engine.executor.device.type == "cuda"
        runner = engine.executor.runner
        if runner.graphs is None and engine.config.tensor_parallel_size == 1:
            self.scope = "model forward + compute_logits"
            runner.model.forward = self.wrap(runner.model.forward)
            runner.model.compute_logits = self.wrap(runner.model.compute_logits)
        else:
            self.scope = "executor.execute (CUDA graph replay or workers: staging included)"
            engine.executor.execute = self.wrap(engine.executor.execute)

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if self.profiler is not None:
                self.profiler.disable()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.cuda:
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - start
            if self.profiler is not None:
                self.profiler.enable()
            return out

        return timed


def add_requests(engine: LLMEngine, num: int, min_len: int, max_len: int, temperature: float, seed: int) -> None:
    rng = random.Random(seed)
    vocab = min(engine.vocab_size, 10000)
    for i in range(num):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))]
        params = SamplingParams(temperature=temperature, max_tokens=rng.randint(min_len, max_len), ignore_eos=True)
        engine.add_request(f"req-{i}", {"prompt_token_ids": prompt}, params)


def time_steps(engine: LLMEngine, timer: ModelTimer, steps: int, outputs: str) -> list[tuple[float, float, int]]:
    """(step seconds, execute seconds, batch size) of each step."""
    out = []
    for _ in range(steps):
        timer.seconds = 0.0
        batch = len(engine.scheduler.running)
        start = time.perf_counter()
        engine.step(outputs=outputs) if outputs != "all" else engine.step()
        out.append((time.perf_counter() - start, timer.seconds, batch))
    return out


def summarize(samples: list[tuple[float, float, int]]) -> dict:
    total = [s for s, _, _ in samples]
    model = [m for _, m, _ in samples]
    host = [s - m for s, m, _ in samples]
    ms = lambda xs: round(1000 * statistics.median(xs), 3)  # noqa: E731
    return {"steps": len(samples), "batch_min": min(b for *_, b in samples), "total_ms": ms(total),
            "model_execute_ms": ms(model), "host_ms": ms(host), "host_ms_mean": round(1000 * statistics.mean(host), 3),
            "host_ms_min": round(1000 * min(host), 3)}


def profile_top(profiler: cProfile.Profile, steps: int, limit: int) -> list[dict]:
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (file, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():
        rows.append({"function": f"{os.path.basename(file)}:{line}:{name}", "calls_per_step": round(calls / steps, 1),
                     "tottime_ms_per_step": round(1000 * tottime / steps, 3),
                     "cumtime_ms_per_step": round(1000 * cumtime / steps, 3)})
    rows.sort(key=lambda r: (r["cumtime_ms_per_step"], r["tottime_ms_per_step"]), reverse=True)
    return rows[:limit]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="preset or HF dir (default: a tiny random Llama in a temp dir)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=0.6, help="0 for the all-greedy sampler path")
    parser.add_argument("--outputs", default="all", choices=["all", "finished"],
                        help="engine.step(outputs=...): every progressing request's output, or finished ones only")
    parser.add_argument("--token-budget", type=int, default=16384, help="max_num_batched_tokens (prefill speed only)")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps (and as many profiled)")
    parser.add_argument("--top", type=int, default=20, help="profile entries reported")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as fh:
                json.dump(TINY_LLAMA, fh)
            model = tmp
        config = EngineConfig(model=model, load_format="dummy", device=args.device, dtype=args.dtype,
                              max_model_len=args.max_model_len, max_num_seqs=args.num_requests,
                              max_num_batched_tokens=args.token_budget)
        engine = LLMEngine(config, progress=False)
    timer = ModelTimer(engine)
    # Short outputs would finish during the timed steps; every request must outlive them.
    add_requests(engine, args.num_requests, args.min_len, args.max_len, args.temperature, args.seed)
    start = time.perf_counter()
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()  # prefill until every request decodes
    print(f"prefill done in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    needed = 2 * args.steps + 2
    short = [r for r in engine.requests.values() if r.params.max_tokens - r.seqs[0].num_output_tokens < needed]
    if short:
        raise SystemExit(f"--min-len {args.min_len} is too small for 2 x --steps {args.steps} decode steps")
    time_steps(engine, timer, 2, args.outputs)  # warm-up
    plain = summarize(time_steps(engine, timer, args.steps, args.outputs))
    profiler = cProfile.Profile()
    timer.profiler = profiler
    profiler.enable()
    profiled = time_steps(engine, timer, args.steps, args.outputs)
    profiler.disable()
    timer.profiler = None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "bench": "host_overhead", "commit": commit, "device": str(engine.executor.device), "torch": torch.__version__,
        "model": args.model or "tiny-llama(hidden 64, 2 layers, vocab 1000)", "num_requests": args.num_requests,
        "temperature": args.temperature, "outputs": args.outputs, "model_time": timer.scope,
        "decode": plain, "decode_profiled": summarize(profiled),
        "profile_top_cumtime": profile_top(profiler, args.steps, args.top),
    }
    engine.shutdown()
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
