"""Decode context parallelism on GPUs: DCP1 vs DCP D at the same TP size and per-GPU KV memory.

For each configuration (TP T with DCP 1, and DCP D with each merge backend) one engine is built
on random weights of a named preset, then:
  - KV capacity in tokens and in concurrent max-length requests (from the allocator, per rank);
  - greedy tokens on a fixed prompt set (prompts longer than the QSA budget, so selection matters),
    compared across configurations;
  - batch-1 decode tok/s and TTFT at each context length: one request whose prompt fills the
    context, timed step by step through the engine (TTFT = first token; decode rate over the rest).
Prints one JSON document (and writes it to --out).

  python benchmarks/bench_dcp.py --preset qwen4exp-small-1kv --tp 2 --dcp 2 --contexts 8192,131072
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import subprocess
import sys
import time

import torch

from qsaserve import LLM, SamplingParams


def fixed_prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(5, vocab) for _ in range(n)]} for n in lengths]


def timed_request(engine, prompt_len: int, new_tokens: int, vocab: int, seed: int) -> dict:
    """One request alone in the engine: TTFT and the decode rate after the first token."""
    rng = random.Random(seed)
    prompt = {"prompt_token_ids": [rng.randrange(5, vocab) for _ in range(prompt_len)]}
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    rid = f"timed-{prompt_len}-{seed}"
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    stamps: list[float] = []
    produced = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
            if n > produced:
                produced = n
                stamps.append(time.perf_counter())
    ttft = stamps[0] - start
    decode_s = stamps[-1] - stamps[0]
    return {"prompt_len": prompt_len, "new_tokens": produced, "ttft_s": ttft,
            "decode_tok_s": (produced - 1) / decode_s if decode_s > 0 else None,
            "decode_step_ms": 1e3 * decode_s / max(produced - 1, 1)}


def run_config(args, dcp: int, backend: str, prompts: list[dict]) -> dict:
    t0 = time.perf_counter()
    llm = LLM(args.preset, load_format="dummy", progress=False, tensor_parallel_size=args.tp,
              decode_context_parallel_size=dcp, dcp_comm_backend=backend, max_model_len=args.max_model_len,
              kv_cache_memory=int(args.kv_cache_gib * 2**30), max_num_batched_tokens=args.chunk,
              max_num_seqs=max(len(prompts), 1), seed=0, ple_placement=args.ple_placement,
              **({"enforce_eager": True} if args.enforce_eager else {}))
    eng = llm.engine
    try:
        return _measure(args, llm, eng, dcp, backend, prompts, time.perf_counter() - t0)
    finally:
        eng.shutdown()
        del llm, eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _measure(args, llm, eng, dcp: int, backend: str, prompts: list[dict], startup_s: float) -> dict:
    ours, _ = eng.executor.capacity(eng.max_model_len)
    res = {
        "dcp": dcp, "backend": backend if dcp > 1 else None, "startup_s": startup_s,
        "kv_tokens": ours.tokens, "max_len_requests": ours.max_len_requests,
        "kv_bytes_per_token_per_rank": eng.executor.kv_spec.bytes_per_token,
        "engine_block_tokens": ours.block_tokens,
    }
    print(json.dumps({"progress": "capacity", **res}), file=sys.stderr, flush=True)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.greedy_tokens, ignore_eos=True),
                        use_tqdm=False)
    res["greedy_tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    print(json.dumps({"progress": "greedy", "dcp": dcp, "backend": backend, "tokens": res["greedy_tokens"]}),
          file=sys.stderr, flush=True)
    vocab = eng.vocab_size
    timed_request(eng, min(512, eng.max_model_len // 2), 8, vocab, seed=99)  # warm-up: kernels compiled and tuned
    res["timed"] = []
    for ctx in args.contexts:
        r = timed_request(eng, ctx - args.decode_tokens, args.decode_tokens, vocab, seed=ctx)
        res["timed"].append(r)
        print(json.dumps({"progress": "timed", "dcp": dcp, "backend": backend, **r}), file=sys.stderr, flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen4exp-small-1kv")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dcp", type=int, default=2)
    p.add_argument("--backends", default="ag_rs,a2a")
    p.add_argument("--contexts", default="8192,131072")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--greedy-tokens", type=int, default=16)
    p.add_argument("--prompt-lengths", default="300,2500,3100,5000", help="fixed prompt set (QSA budget is 2048)")
    p.add_argument("--max-model-len", type=int, default=131072 + 256)
    p.add_argument("--kv-cache-gib", type=float, default=16.0, help="KV budget per GPU, the same for every config")
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (prefill chunk)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--ple-placement", default="gpu", help="gpu: random PLE tables made on the device (fast startup)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    lengths = [int(x) for x in args.prompt_lengths.split(",") if x]

    from qsaserve.models.presets import preset_config

    prompts = fixed_prompts(preset_config(args.preset)["vocab_size"], lengths)
    commit = os.environ.get("QSASERVE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "benchmark": "decode context parallelism",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "num_gpus": torch.cuda.device_count(), "date": datetime.date.today().isoformat(), "commit": commit,
        "torch": torch.__version__, "preset": args.preset, "weights": "random (load_format=dummy)",
        "tensor_parallel_size": args.tp, "kv_cache_gib_per_gpu": args.kv_cache_gib, "max_model_len": args.max_model_len,
        "prefill_chunk": args.chunk, "enforce_eager": args.enforce_eager, "prompt_lengths": lengths, "runs": [],
    }
    configs = [(1, "ag_rs")] + [(args.dcp, b) for b in args.backends.split(",") if b]
    for dcp, backend in configs:
        try:
            report["runs"].append(run_config(args, dcp, backend, prompts))
        except Exception as exc:  # report and go on: one failing configuration must not hide the others
            report["runs"].append({"dcp": dcp, "backend": backend, "error": repr(exc)})
            print(json.dumps(report["runs"][-1]), file=sys.stderr, flush=True)
        _write(args.out, report)  # after every configuration: a run cut short keeps what it measured
    base = report["runs"][0]
    summary = []
    for run in report["runs"][1:]:
        if "error" in run or "error" in base:
            continue
        row = {"dcp": run["dcp"], "backend": run["backend"],
               "capacity_ratio": run["kv_tokens"] / base["kv_tokens"],
               "greedy_identical_to_dcp1": run["greedy_tokens"] == base["greedy_tokens"]}
        for mine, ref in zip(run["timed"], base["timed"]):
            if mine["decode_tok_s"] and ref["decode_tok_s"]:
                row[f"decode_speed_ratio_ctx{mine['prompt_len'] + args.decode_tokens}"] = mine["decode_tok_s"] / ref["decode_tok_s"]
        summary.append(row)
    report["summary_vs_dcp1"] = summary
    _write(args.out, report)
    print(json.dumps(report, indent=1))


def _write(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
