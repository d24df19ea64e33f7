"""`qsaserve qualify [MODEL] --candidate NAME:KEY=VAL,... [--baseline KEY=VAL,...] -o report.json`.

Every engine is the common engine flags plus its own overrides (EngineConfig field names), e.g.
  qsaserve qualify --dtype float32 --baseline kv_cache_dtype=bfloat16 \\
      --candidate fp8:kv_cache_dtype=fp8_e4m3,kv_scales=scales.json -o report.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import shlex
import sys
import time
from dataclasses import fields

from qsaserve.config import EngineConfig
from qsaserve.errors import InvalidRequestError

logger = logging.getLogger("qsaserve")

DEFAULT_NUM_TOKENS = 4096
DEFAULT_WINDOW = 512


def parse_overrides(text: str, what: str) -> dict:
    """'k=v,k=v' -> {k: typed v}, typed by EngineConfig's field types ('none' -> None)."""
    types = {f.name: str(f.type) for f in fields(EngineConfig)}
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in types:
            raise InvalidRequestError(what, f"expected KEY=VALUE with an engine argument as KEY, got {item!r}")
        kind = types[key]
        if value.lower() == "none":
            out[key] = None
        elif "bool" in kind:
            if value.lower() not in ("true", "false"):
                raise InvalidRequestError(what, f"{key} must be true or false, got {value!r}")
            out[key] = value.lower() == "true"
        elif "int" in kind:
            out[key] = int(value)
        elif "float" in kind:
            out[key] = float(value)
        else:
            out[key] = value
    return out


def run_qualify(common: dict, baseline: dict, candidates: dict[str, dict], dataset, *, num_tokens: int = DEFAULT_NUM_TOKENS,
                window: int = DEFAULT_WINDOW, chunk_size: int = 256) -> dict:
    """Builds the engines (common args + overrides), scores `dataset` and returns the report."""
    from qsaserve.entrypoints.llm import LLM
    from qsaserve.quant.dataset import token_windows
    from qsaserve.qualify.compare import compare_engines, describe_engine

    common = {"max_model_len": window, **common}
    t0 = time.perf_counter()
    base_llm = LLM(progress=False, **{**common, **baseline})
    cand_llms = {name: LLM(progress=False, **{**common, **over}) for name, over in candidates.items()}
    t_load = time.perf_counter() - t0
    engine = base_llm.engine
    if engine.tokenizer is None:
        raise InvalidRequestError("model", "qualify needs a model with a tokenizer")
    windows = token_windows(engine.tokenizer, dataset.texts, window, num_tokens)
    t1 = time.perf_counter()
    metrics = compare_engines(base_llm, cand_llms, windows, chunk_size)
    report = {
        "model": engine.checkpoint.path,
        "model_identity": engine.checkpoint.identity,
        "model_dtype": str(engine.executor.dtype).removeprefix("torch."),
        "device": str(engine.executor.device),
        "dataset": dataset.description,
        "num_tokens": sum(len(w) for w in windows),
        "window": window,
        "common_engine_args": common,
        "num_windows": metrics["num_windows"],
        "num_positions": metrics["num_positions"],
        "baseline": {"engine_args": baseline, **describe_engine(base_llm), **metrics["baseline"]},
        "candidates": {name: {"engine_args": candidates[name], **describe_engine(cand_llms[name]), **m}
                       for name, m in metrics["candidates"].items()},
        "metrics": {
            "perplexity": "exp(mean NLL of the next token), teacher-forced, each window an independent context",
            "ppl_change_pct": "100 * (candidate perplexity / baseline perplexity - 1)",
            "kl_mean": "mean over positions of KL(baseline || candidate) over the full vocabulary, nats",
            "top1_agreement": "fraction of positions whose argmax token is the baseline's",
        },
        "load_s": round(t_load, 1),
        "score_s": round(time.perf_counter() - t1, 1),
    }
    return report


def add_qualify_parser(subparsers) -> argparse.ArgumentParser:
    from qsaserve.engine_args import add_engine_args
    from qsaserve.quant.cli import add_model_tag

    p = subparsers.add_parser(
        "qualify", help="compare candidate engine configurations to a baseline (perplexity, KL, top-1 agreement)",
        description="Teacher-force the same token stream through a baseline and candidate engines and compare "
                    "their full-vocabulary distributions.")
    add_model_tag(p)
    p.add_argument("--baseline", default="", help="baseline overrides KEY=VAL,... of engine arguments (default: none)")
    p.add_argument("--candidate", action="append", required=True, metavar="NAME:KEY=VAL,...",
                   help="a candidate configuration (repeatable)")
    p.add_argument("-o", "--output", default=None, help="report JSON to write (default: print only)")
    p.add_argument("--dataset", default=None, help="UTF-8 text file to evaluate on (default: the held-out part of "
                   "CPython's pydoc_data.topics, never used by `qsaserve calibrate`)")
    p.add_argument("--num-tokens", type=int, default=DEFAULT_NUM_TOKENS, help=f"tokens to score (default: {DEFAULT_NUM_TOKENS})")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, help=f"tokens per independent context (default: {DEFAULT_WINDOW})")
    add_engine_args(p)
    p.set_defaults(func=cmd_qualify)
    return p


def cmd_qualify(args) -> int:
    from qsaserve.engine_args import engine_config_from_args
    from qsaserve.quant.cli import resolve_model_tag
    from qsaserve.quant.dataset import pydoc_topics, text_file

    resolve_model_tag(args)
    defaults = EngineConfig()
    config = engine_config_from_args(args)
    common = {k: v for k, v in config.__dict__.items() if v != getattr(defaults, k)}
    candidates = {}
    for spec in args.candidate:
        name, sep, rest = spec.partition(":")
        if not sep or not name:
            raise InvalidRequestError("candidate", f"expected NAME:KEY=VAL,..., got {spec!r}")
        candidates[name] = parse_overrides(rest, "candidate")
    dataset = text_file(args.dataset) if args.dataset else pydoc_topics("evaluation")
    report = run_qualify(common, parse_overrides(args.baseline, "baseline"), candidates, dataset,
                         num_tokens=args.num_tokens, window=args.window)
    report["command"] = shlex.join(sys.argv)
    report["date"] = datetime.date.today().isoformat()
    text = json.dumps(report, indent=2)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
    print(format_table(report))
    return 0


def format_table(report: dict) -> str:
    b = report["baseline"]
    lines = [f"{report['num_positions']} positions in {report['num_windows']} windows; baseline "
             f"{b['kv_cache_dtype']} KV perplexity {b['perplexity']:.4f}",
             "| candidate | KV dtype | bytes/token | perplexity | change | mean KL (nats) | top-1 agreement | "
             "flips at baseline margin < 0.1 / >= 0.5 |",
             "|---|---|---|---|---|---|---|---|"]
    for name, c in report["candidates"].items():
        hist = c.get("top1_flip_margin_histogram", {})
        near = sum(hist.get(k, 0) for k in ("<0.01", "0.01-0.05", "0.05-0.1"))
        wide = sum(hist.get(k, 0) for k in ("0.5-1.0", ">=1.0"))
        lines.append(f"| {name} | {c['kv_cache_dtype']} | {c['kv_bytes_per_token']:.0f} | {c['perplexity']:.4f} | "
                     f"{c['ppl_change_pct']:+.3f}% | {c['kl_mean']:.2e} | {100 * c['top1_agreement']:.2f}% | "
                     f"{near} / {wide} of {c.get('top1_flips', '?')} |")
    return "\n".join(lines)
