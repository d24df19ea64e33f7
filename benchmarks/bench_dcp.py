"""Decode context parallelism on GPUs: DCP1 vs DCP D at the same TP size and per-GPU KV memory.

For each configuration (TP T with DCP 1, and DCP D with each merge backend) one engine is built
on random weights of a named preset, then:
  - KV capacity in tokens and in concurrent max-length requests (from the allocator, per rank);
  - greedy tokens on a fixed prompt set (prompts longer than the QSA budget, so selection matters),
    compared across configurations;
  - batch-1 decode tok/s and TTFT at each context length: one request whose prompt fills the
    context, timed step by step through the engine (TTFT = first token; decode rate over the rest);
  - a step breakdown at the first context (bench.step_profile: wall, executor, CUDA kernels of rank 0).
Greedy runs ask for the top logprobs, so where DCP D parts from DCP1 the report gives DCP1's
margin between its best and next-best logit there (random weights give near-flat logits: bf16 summation order can flip a
near-tie). With --identity-dtype float32, DCP1 and DCP D also run the prompt set in float32
(eager), where such ties are ~1e-6 apart, and the report says whether those tokens are identical.
Every configuration runs in a fresh process (this script re-invoked with --one): a second engine
built in the same process measured ~0.2 ms/step slower at 8K than the first, on rank 0 only, and
whichever configuration ran second took that penalty
(`dcp_order_diag_qwen4exp_small_1kv_h200x2_2026-11-30_8368588.json`; the likely cause, a process-group
teardown that hung while CUDA graphs were alive, is addressed in ModelRunner.free_graphs and
measured by bench_engine_restart.py).
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
import tempfile
import time
import traceback

import torch

from qsaserve import LLM, SamplingParams
from qsaserve.bench.common import source_commit


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


def run_config(args, dcp: int, backend: str, prompts: list[dict], identity_dtype: str | None = None) -> dict:
    """One engine; the full measurement, or with identity_dtype only greedy tokens in that dtype."""
    t0 = time.perf_counter()
    eager = args.enforce_eager or identity_dtype is not None
    llm = LLM(args.preset, load_format="dummy", progress=False, tensor_parallel_size=args.tp,
              decode_context_parallel_size=dcp, dcp_comm_backend=backend, max_model_len=args.max_model_len,
              kv_cache_memory=int(args.kv_cache_gib * 2**30), max_num_batched_tokens=args.chunk,
              max_num_seqs=max(len(prompts), 1), seed=0, ple_placement=args.ple_placement,
              async_scheduling=args.async_scheduling and identity_dtype is None,
              **({"enforce_eager": True} if eager else {}), **({"dtype": identity_dtype} if identity_dtype else {}))
    eng = llm.engine
    try:
        if identity_dtype is not None:
            return {"dcp": dcp, "backend": backend, "dtype": identity_dtype, **greedy(args, llm, prompts)}
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
    res.update(greedy(args, llm, prompts))
    print(json.dumps({"progress": "greedy", "dcp": dcp, "backend": backend, "tokens": res["greedy_tokens"]}),
          file=sys.stderr, flush=True)
    if args.greedy_only:
        return res
    vocab = eng.vocab_size
    # Warm-up: kernels compiled and tuned for decode and for a full prefill chunk, so TTFT is not
    # charged with one-time Triton compiles.
    timed_request(eng, min(512, eng.max_model_len // 2), 8, vocab, seed=99)
    timed_request(eng, min(args.chunk + 100, eng.max_model_len // 2), 2, vocab, seed=98)
    res["timed"] = []
    for ctx in args.contexts:
        r = timed_request(eng, ctx - args.decode_tokens, args.decode_tokens, vocab, seed=ctx)
        res["timed"].append(r)
        print(json.dumps({"progress": "timed", "dcp": dcp, "backend": backend, **r}), file=sys.stderr, flush=True)
    if args.profile_steps:
        res["step_profile"] = profile_at(eng, args.contexts[0] - 4 * args.profile_steps, args.profile_steps, vocab)
        print(json.dumps({"progress": "profile", "dcp": dcp, "backend": backend, **res["step_profile"]})[:2000],
              file=sys.stderr, flush=True)
    return res


def greedy(args, llm, prompts: list[dict]) -> dict:
    """Greedy tokens of the fixed prompt set, and at each position the gap between the best and the
    next distinct logprob among the top tp + 1 returned."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.greedy_tokens, ignore_eos=True,
                                                logprobs=args.tp + 1), use_tqdm=False)
    margins = []
    for o in outs:
        row = []
        for entry in o.outputs[0].logprobs:
            top = sorted({lp.logprob for lp in entry.values()}, reverse=True)
            row.append(round(top[0] - top[1], 5) if len(top) > 1 else None)
        margins.append(row)
    return {"greedy_tokens": [list(o.outputs[0].token_ids) for o in outs], "greedy_top2_margins": margins}


def profile_at(eng, prompt_len: int, steps: int, vocab: int) -> dict:
    """One request of prompt_len tokens, prefilled, then bench.step_profile over its decode steps."""
    from qsaserve.bench.step_profile import profile_decode_steps

    rng = random.Random(7)
    params = SamplingParams(temperature=0, max_tokens=2 * steps + 4, ignore_eos=True)
    eng.add_request("profiled", {"prompt_token_ids": [rng.randrange(5, vocab) for _ in range(prompt_len)]}, params)
    seq = eng.requests["profiled"].seqs[0]
    while seq.num_output_tokens < 2:
        eng.step(outputs="finished")
    try:
        return {"prompt_len": prompt_len, **profile_decode_steps(eng, steps)}
    finally:
        eng.abort_request("profiled")


def divergences(run: dict, base: dict) -> list[dict]:
    """Where each prompt's greedy tokens first differ from the base run's, with the base's margin there."""
    out = []
    for i, (mine, ref) in enumerate(zip(run["greedy_tokens"], base["greedy_tokens"])):
        pos = next((j for j, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
        if pos is not None:
            margins = base.get("greedy_top2_margins")
            out.append({"prompt": i, "position": pos,
                        "base_top2_margin": margins[i][pos] if margins else None})
    return out


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
    p.add_argument("--profile-steps", type=int, default=16, help="step breakdown at the first context; 0: off")
    p.add_argument("--identity-dtype", default=None, help="e.g. float32: also compare greedy tokens in this dtype")
    p.add_argument("--async-scheduling", action="store_true",
                   help="every timed configuration with async scheduling (rank 0 feeds tokens on the device)")
    p.add_argument("--greedy-only", action="store_true", help="capacity and greedy tokens only (no timed requests)")
    p.add_argument("--out", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: DCP,BACKEND,DTYPE in this process
    p.add_argument("--one-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    lengths = [int(x) for x in args.prompt_lengths.split(",") if x]

    from qsaserve.models.presets import preset_config

    prompts = fixed_prompts(preset_config(args.preset)["vocab_size"], lengths)
    if args.one:  # one configuration, in this (fresh) process
        dcp, backend, dtype = args.one.split(",")
        try:
            result = run_config(args, int(dcp), backend, prompts, dtype or None)
            result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        except Exception as exc:  # the parent records it and goes on
            traceback.print_exc()
            result = {"dcp": int(dcp), "backend": backend, "error": repr(exc)}
        with open(args.one_out, "w", encoding="utf-8") as fh:
            json.dump(result, fh)
        return
    commit = source_commit()
    report = {
        "benchmark": "decode context parallelism",
        "isolation": "each configuration in a fresh process",
        "device": None,  # from the first configuration (no CUDA context in this process: it holds no rank)
        "num_gpus": torch.cuda.device_count(), "date": datetime.date.today().isoformat(), "commit": commit,
        "torch": torch.__version__, "preset": args.preset, "weights": "random (load_format=dummy)",
        "tensor_parallel_size": args.tp, "kv_cache_gib_per_gpu": args.kv_cache_gib, "max_model_len": args.max_model_len,
        "prefill_chunk": args.chunk, "enforce_eager": args.enforce_eager, "async_scheduling": args.async_scheduling, "prompt_lengths": lengths, "runs": [],
    }
    configs = [(1, "ag_rs")] + [(args.dcp, b) for b in args.backends.split(",") if b]
    for dcp, backend in configs:
        try:
            report["runs"].append(run_in_subprocess(dcp, backend))
            report["device"] = report["device"] or report["runs"][-1].get("device")
        except Exception as exc:  # report and go on: one failing configuration must not hide the others
            report["runs"].append({"dcp": dcp, "backend": backend, "error": repr(exc)})
            print(json.dumps(report["runs"][-1]), file=sys.stderr, flush=True)
        _write(args.out, report)  # after every configuration: a run cut short keeps what it measured
    if args.identity_dtype:
        report["identity_runs"] = []
        for dcp in (1, args.dcp):
            try:
                report["identity_runs"].append(run_in_subprocess(dcp, "ag_rs", args.identity_dtype))
            except Exception as exc:
                report["identity_runs"].append({"dcp": dcp, "error": repr(exc)})
            _write(args.out, report)
        ok = [r for r in report["identity_runs"] if "error" not in r]
        if len(ok) == 2:
            report["identity"] = {"dtype": args.identity_dtype,
                                  "greedy_identical": ok[1]["greedy_tokens"] == ok[0]["greedy_tokens"],
                                  "divergences": divergences(ok[1], ok[0])}
    base = report["runs"][0]
    summary = []
    for run in report["runs"][1:]:
        if "error" in run or "error" in base:
            continue
        row = {"dcp": run["dcp"], "backend": run["backend"],
               "capacity_ratio": run["kv_tokens"] / base["kv_tokens"],
               "greedy_identical_to_dcp1": run["greedy_tokens"] == base["greedy_tokens"],
               "greedy_divergences": divergences(run, base)}
        for mine, ref in zip(run.get("timed", []), base.get("timed", [])):
            if mine["decode_tok_s"] and ref["decode_tok_s"]:
                row[f"decode_speed_ratio_ctx{mine['prompt_len'] + args.decode_tokens}"] = mine["decode_tok_s"] / ref["decode_tok_s"]
        summary.append(row)
    report["summary_vs_dcp1"] = summary
    _write(args.out, report)
    print(json.dumps(report, indent=1))


CONFIG_TIMEOUT_S = 1800  # one configuration: a hung collective must not stall the whole run


def run_in_subprocess(dcp: int, backend: str, dtype: str | None = None) -> dict:
    """run_config in a fresh interpreter (same arguments), so no configuration inherits another's
    process state; its progress lines pass through on stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run.json")
        # the same arguments (the child's --one branch returns before anything reads --out)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--one",
                               f"{dcp},{backend},{dtype or ''}", "--one-out", out], timeout=CONFIG_TIMEOUT_S)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"configuration dcp={dcp} backend={backend} exited with status {proc.returncode} "
                               "(its stderr is above)")
        with open(out, encoding="utf-8") as fh:
            return json.load(fh)


def _write(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
