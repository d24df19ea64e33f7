"""FP8 vs bf16 paged decode, this tree against an earlier paged-attention module, in one run. Prints JSON.

Same shapes as bench_attention's fp8 section (batch 8, 32 q / 8 KV heads, d128, shuffled 16-token
pages). Every call is timed in interleaved rounds (the order reversed every other round, so no
kernel always runs first or last) two ways: triton do_bench (L2 flushed before each call) and
do_bench_cudagraph (back-to-back calls in one CUDA graph, as the engine runs decode). Ratios are
against the bf16 kernel of the same tree; `--baseline FILE` (a self-contained earlier copy of
src/qsaserve/ops/attention/triton_paged.py from before its split into kv_write / decode_triton /
prefill_triton / configs, e.g. from `git show REV:src/...`) adds that file's bf16 and FP8 kernels;
a later baseline is a checkout of its own. `--candidates` names entries of
fp8_decode_candidates.FP8_DECODE_CANDIDATES to time too.
Each FP8 output is compared with the default's (max_abs_diff). About a minute on an H200.

    python benchmarks/bench_fp8_decode_ab.py [--baseline old_triton_paged.py] [--contexts 131072,32768]
        [--rounds 3] [--candidates f16_bn128_s3_r128,...] [--out f.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import D, DT, HKV, HQ, env_info, make_meta, rand_  # noqa: E402

from qsaserve.bench.gpu_timing import do_bench_graph_s, do_bench_s  # noqa: E402
from fp8_decode_candidates import FP8_DECODE_CANDIDATES  # noqa: E402
from qsaserve.ops.attention import configs, decode_triton, triton_paged as tp  # noqa: E402
from qsaserve.ops.device import num_sms  # noqa: E402

SCALE = 0.05  # k_scale = v_scale; bf16 values are clamped to +-4, so |x / scale| <= 80 is finite E4M3


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("baseline_triton_paged", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look the module up while the file executes
    spec.loader.exec_module(mod)
    return mod


def context_row(ctx, args, base):
    b, page = 8, 16
    meta, nb = make_meta([1] * b, [ctx] * b, page, "cuda", seed=ctx)
    q = rand_(torch.empty(b, HQ, D, dtype=DT, device="cuda"))
    out = torch.empty_like(q)
    cache = rand_(torch.empty(2, nb, page, HKV, D, dtype=DT, device="cuda"))
    cache8 = (cache / SCALE).to(torch.float8_e4m3fn)
    ks = torch.tensor(SCALE, device="cuda")
    vs = torch.tensor(SCALE, device="cuda")
    calls = {"bf16": lambda: tp.paged_attention(q, cache, meta, D**-0.5, out=out),
             "fp8": lambda: tp.paged_attention(q, cache8, meta, D**-0.5, out=out, k_scale=ks, v_scale=vs)}
    if base is not None:
        calls["baseline_bf16"] = lambda: base.paged_attention(q, cache, meta, D**-0.5, out=out)
        calls["baseline_fp8"] = lambda: base.paged_attention(q, cache8, meta, D**-0.5, out=out, k_scale=ks, v_scale=vs)
    splits = {}
    for name in args.candidates:
        cfg = FP8_DECODE_CANDIDATES[name]
        n = configs.num_decode_splits(b * HKV, ctx, num_sms(q.device), cfg.block_n, cfg.ctas_per_sm, cfg.min_waves)
        splits[name] = n
        calls[name] = (lambda cfg=cfg, n=n: decode_triton.paged_decode(
            q, cache8, meta.block_tables, meta.seq_lens, meta.cu_query_lens, out, D**-0.5, num_seqs=b,
            max_seq_len=ctx, config=cfg, num_splits=n, k_scale=ks, v_scale=vs))
    ref = {}
    for kind in ("bf16", "fp8"):
        calls[kind]()
        ref[kind] = out.float().clone()
    diffs = {}
    for name, fn in calls.items():
        fn()
        diffs[name] = (out.float() - ref["bf16" if name.endswith("bf16") else "fp8"]).abs().max().item()
    names = list(calls)
    times = {n: {"do_bench_us": [], "graph_us": []} for n in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            times[n]["do_bench_us"].append(do_bench_s(calls[n]) * 1e6)
        for n in order:
            times[n]["graph_us"].append(do_bench_graph_s(calls[n]) * 1e6)
    kv_fp8 = b * ctx * HKV * D * 2  # bytes of E4M3 K and V read
    row = {"ctx": ctx, "batch": b, "fp8_default_splits": configs.num_decode_splits(
        b * HKV, ctx, num_sms(q.device), configs.DECODE_CONFIG_FP8.block_n, configs.DECODE_CONFIG_FP8.ctas_per_sm,
        configs.DECODE_CONFIG_FP8.min_waves), "candidate_splits": splits, "max_abs_diff": diffs, "calls": {}}
    for n in names:
        t = {m: statistics.median(v) for m, v in times[n].items()}
        entry = {**t, "rounds": times[n]}
        for m in ("do_bench_us", "graph_us"):
            bf16 = statistics.median(times["bf16"][m])
            entry[f"speedup_vs_bf16_{m[:-3]}"] = bf16 / t[m]
        entry["tb_s"] = (kv_fp8 * (2 if n.endswith("bf16") else 1)) / t["do_bench_us"] / 1e6
        row["calls"][n] = entry
    return row  # the caches go with this frame


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default=None, help="an earlier triton_paged.py to time beside this tree's")
    ap.add_argument("--contexts", default="131072,32768")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--candidates", default="", help="FP8_DECODE_CANDIDATES names, comma-separated")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.candidates = [c for c in args.candidates.split(",") if c]
    for c in args.candidates:
        if c not in FP8_DECODE_CANDIDATES:
            ap.error(f"--candidates: unknown {c!r}; known: {', '.join(FP8_DECODE_CANDIDATES)}")
    base = load_baseline(args.baseline) if args.baseline else None
    res = {"benchmark": "bench_fp8_decode_ab", "env": env_info(args), "baseline": args.baseline,
           "timing": "medians over interleaved rounds: triton do_bench (L2 flushed) and do_bench_cudagraph",
           "fp8_config": dataclasses.asdict(configs.DECODE_CONFIG_FP8), "rows": []}
    for ctx in (int(x) for x in args.contexts.split(",")):
        row = context_row(ctx, args, base)
        torch.cuda.empty_cache()
        res["rows"].append(row)
        for n, e in row["calls"].items():
            print(f"ctx {ctx:>6} {n:<24} do_bench {e['do_bench_us']:7.1f} us  graph {e['graph_us']:7.1f} us  "
                  f"x{e['speedup_vs_bf16_do_bench']:.3f} / x{e['speedup_vs_bf16_graph']:.3f} vs bf16  "
                  f"diff {row['max_abs_diff'][n]:.1e}", flush=True)
    text = json.dumps(res, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
