"""Stage 1 alone, as one flat report: what benchmarks/fp8_quality.py records for each KV variant
(the layout `qsaserve qualify` wrote before it had stages): perplexity, KL, top-1 agreement and
the flips by margin of every candidate against the baseline, plus its KV dtype and bytes/token."""
from __future__ import annotations

import os
import tempfile

from qsaserve.qualify.runner import Configuration, Settings, run

KEEP = ("kv_cache_dtype", "kv_dtype_reason", "kv_bytes_per_token", "model_identity", "model_dtype", "device")


def run_qualify(common: dict, baseline: dict, candidates: dict[str, dict], dataset, *, num_tokens: int, window: int) -> dict:
    configs = [Configuration("baseline", "baseline", baseline)]
    configs += [Configuration(name, "candidate", over) for name, over in candidates.items()]
    with tempfile.TemporaryDirectory(prefix="qsaserve-tf-") as scratch:
        body = run({"max_model_len": window, **common}, configs, dataset, ["teacher_forced"], os.path.join(scratch, "rows"),
                   settings=Settings(num_tokens=num_tokens, window=window))
    recs, results = body["records"], body["results"]["candidates"]
    first = next(iter(results.values()))["teacher_forced"]["metrics"]
    return {
        "model": recs["baseline"]["model"], "model_identity": recs["baseline"]["model_identity"],
        "dataset": body["inputs"]["text"], "window": window, "common_engine_args": common,
        "num_windows": body["inputs"]["teacher_forced"]["windows"], "num_positions": first["positions"],
        "baseline": {"engine_args": baseline, **{k: recs["baseline"][k] for k in KEEP},
                     "perplexity": first["baseline_perplexity"], "top2_margin_histogram": first["baseline_top2_margin_histogram"]},
        "candidates": {name: {"engine_args": candidates[name], **{k: recs[name][k] for k in KEEP},
                              "status": st["teacher_forced"]["status"], "reasons": st["teacher_forced"]["reasons"],
                              **{k: v for k, v in st["teacher_forced"]["metrics"].items()
                                 if not k.startswith("_") and not k.startswith("baseline_")}}
                       for name, st in results.items()},
        "timings_s": body["timings_s"],
    }


def format_table(report: dict) -> str:
    b = report["baseline"]
    lines = [f"{report['num_positions']} positions in {report['num_windows']} windows; baseline "
             f"{b['kv_cache_dtype']} KV perplexity {b['perplexity']:.4f}",
             "| candidate | KV dtype | bytes/token | perplexity | change | mean KL (nats) | top-1 agreement | "
             "flips at baseline margin < 0.1 / >= 1.0 |",
             "|---|---|---|---|---|---|---|---|"]
    for name, c in report["candidates"].items():
        hist = c["top1_flip_margin_histogram"]
        near = sum(hist[k] for k in ("<0.01", "0.01-0.05", "0.05-0.1"))
        lines.append(f"| {name} | {c['kv_cache_dtype']} | {c['kv_bytes_per_token']:.0f} | {c['perplexity']:.4f} | "
                     f"{c['ppl_change_pct']:+.3f}% | {c['kl_mean']:.2e} | {100 * c['top1_agreement']:.2f}% | "
                     f"{near} / {hist['>=1.0']} of {c['top1_flips']} |")
    return "\n".join(lines)
