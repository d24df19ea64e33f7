"""`qsaserve qualify [MODEL] --baseline KEY=VAL,... --candidate NAME:KEY=VAL,... -o DIR`.

Every configuration is the common engine flags plus its own overrides (EngineConfig field names):
  qsaserve qualify --dtype float32 --kv-cache-memory 268435456 --baseline kv_cache_dtype=bfloat16 \\
      --candidate fp8:kv_cache_dtype=fp8_e4m3,kv_scales=scales.json -o qualify-fp8
writes qualify-fp8/report.json and qualify-fp8/report.html. Exit status: 0 when every candidate
passes, 1 when one fails, 2 when none fails but one is inconclusive.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import shlex
import sys
import time
from dataclasses import fields

from qsaserve.config import EngineConfig
from qsaserve.errors import InvalidRequestError

logger = logging.getLogger("qsaserve")


SPEC = "speculative_config"
FALLBACK = "disable_when_slower"


def split_items(text: str) -> list[str]:
    """Splits on the commas outside braces, brackets and double quotes (a JSON value keeps its own)."""
    items, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(text):
        if ch == '"' and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        elif not quoted and ch in "{[":
            depth += 1
        elif not quoted and ch in "}]":
            depth -= 1
        elif not quoted and not depth and ch == ",":
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [s.strip() for s in items if s.strip()]


def parse_overrides(text: str, what: str) -> dict:
    """'k=v,k=v' -> {k: typed v}, typed by EngineConfig's field types ('none' -> None).

    speculative_config takes vLLM's JSON (`speculative_config={"method":"mtp","num_speculative_tokens":3}`,
    single-quoted in a shell) or one key per field (`speculative_config.method=mtp,
    speculative_config.num_speculative_tokens=3`, no quoting needed); either becomes the validated dict."""
    types = {f.name: str(f.type) for f in fields(EngineConfig)}
    out, spec_fields = {}, {}
    for item in split_items(text):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if sep and key.startswith(SPEC + "."):
            spec_fields[key.removeprefix(SPEC + ".")] = value.strip()
            continue
        if not sep or key not in types:
            raise InvalidRequestError(what, f"expected KEY=VALUE with an engine argument as KEY, got {item!r}")
        kind = types[key]
        if value.lower() == "none":
            out[key] = None
        elif key == SPEC:
            out[key] = _speculative_config(value, what)
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
    if spec_fields:
        if SPEC in out:
            raise InvalidRequestError(what, f"give {SPEC} either as JSON or as {SPEC}.FIELD=VALUE items, not both")
        out[SPEC] = _speculative_config(_typed_spec_fields(spec_fields, what), what)
    return out


def _typed_spec_fields(values: dict[str, str], what: str) -> dict:
    """speculative_config.FIELD=VALUE strings typed by SpeculativeConfig's field types."""
    from qsaserve.speculative_config import SpeculativeConfig

    types = {f.name: str(f.type) for f in fields(SpeculativeConfig)}
    out = {}
    for name, value in values.items():
        if name not in types:
            raise InvalidRequestError(what, f"{SPEC}.{name}: unknown field; known: {', '.join(sorted(types))}")
        if value.lower() == "none":
            out[name] = None
        elif "int" in types[name]:
            try:
                out[name] = int(value)
            except ValueError:
                raise InvalidRequestError(what, f"{SPEC}.{name}: must be an integer, got {value!r}") from None
        elif "bool" in types[name]:
            if value.lower() not in ("true", "false"):
                raise InvalidRequestError(what, f"{SPEC}.{name}: must be true or false, got {value!r}")
            out[name] = value.lower() == "true"
        else:
            out[name] = value
    return out


def _speculative_config(value, what: str) -> dict:
    """JSON text or a dict -> the validated speculative_config as a plain dict (reports show it).

    Unless the configuration sets it, the engine's per-step fallback (disable_when_slower) is off:
    with it, how many steps draft depends on this machine's timings, and so would the acceptance
    that stage 2 compares; qualify measures every draft (docs/qualify.md)."""
    from qsaserve.speculative_config import parse_speculative_config

    try:
        out = parse_speculative_config(value).to_dict()
    except InvalidRequestError as exc:  # its message names the field: speculative_config.FIELD: ...
        raise InvalidRequestError(what, str(exc)) from None
    given = json.loads(value) if isinstance(value, str) else value
    if FALLBACK not in given:
        out[FALLBACK] = False
    return out


def parse_candidate(spec: str) -> tuple[str, dict]:
    name, sep, rest = spec.partition(":")
    if not sep or not name or name in ("baseline", "oracle"):
        raise InvalidRequestError("candidate", f"expected NAME:KEY=VAL,... with NAME not baseline/oracle, got {spec!r}")
    return name, parse_overrides(rest, "candidate")


def add_qualify_parser(subparsers) -> argparse.ArgumentParser:
    from qsaserve.engine_args import add_engine_args
    from qsaserve.quant.cli import add_model_tag
    from qsaserve.qualify.runner import STAGES, Settings

    d = Settings()
    p = subparsers.add_parser(
        "qualify", help="prove candidate engine configurations as good as a baseline (report.json + report.html)",
        description="Run the qualification stages (teacher-forced distribution, token gate, FP64 oracle, paired "
                    "tasks, health, capacity, provenance) on a baseline and candidates; a verdict per candidate.")
    add_model_tag(p)
    p.add_argument("--baseline", default="", help="baseline overrides KEY=VAL,... of engine arguments (default: none)")
    p.add_argument("--candidate", action="append", required=True, metavar="NAME:KEY=VAL,...",
                   help="a candidate configuration (repeatable)")
    p.add_argument("--oracle", default="", metavar="KEY=VAL,...",
                   help="overrides of the FP64 oracle's engine (default: dtype=float64,device=cpu, one rank)")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="directory for report.json and report.html")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)} (default: all)")
    p.add_argument("--rule", action="append", metavar="KEY=VALUE", help="set a pass-rule number (see docs/qualify.md)")
    p.add_argument("--strict-provenance", action="store_true",
                   help="fail provenance on a shadowed import, a dirty checkout or a modified wheel, not only warn")
    p.add_argument("--dataset", default=None, help="UTF-8 text file (default: the held-out part of CPython's "
                   "pydoc_data.topics, never used by `qsaserve calibrate`)")
    p.add_argument("--num-tokens", type=int, default=d.num_tokens, help=f"teacher-forced tokens (default: {d.num_tokens})")
    p.add_argument("--window", type=int, default=d.window, help=f"tokens per independent context (default: {d.window})")
    p.add_argument("--gate-tokens", type=int, default=d.gate_tokens, help=f"greedy tokens per gate prompt (default: {d.gate_tokens})")
    p.add_argument("--gate-long-tokens", type=int, default=d.gate_long_tokens,
                   help=f"length of the long marked gate prompt (default: {d.gate_long_tokens})")
    p.add_argument("--oracle-seeds", type=int, default=len(d.oracle_seeds), help="oracle samples, one seed each "
                   f"(default: {len(d.oracle_seeds)})")
    p.add_argument("--oracle-tokens", type=int, default=d.oracle_tokens, help=f"tokens per oracle sample (default: {d.oracle_tokens})")
    p.add_argument("--tasks", action="append", default=[], metavar="FILE.jsonl|lmeval:NAME",
                   help="extra task: a JSONL file or an lm-eval task name (repeatable; the generated tasks always run)")
    p.add_argument("--arithmetic-items", type=int, default=d.arithmetic_items,
                   help=f"generated arithmetic items (default: {d.arithmetic_items})")
    p.add_argument("--long-items", type=int, default=d.long_items,
                   help=f"items per length of each generated retrieval task (default: {d.long_items})")
    p.add_argument("--task-temperature", type=float, default=0.0, help="task sampling temperature (default: 0, greedy; "
                   "per-item seeds are the same on both sides either way)")
    p.add_argument("--prefill-tokens", type=int, default=d.prefill_tokens, help="prompt length of the prefill timing")
    p.add_argument("--decode-batch", type=int, default=d.decode_batch, help="sequences of the decode timing")
    p.add_argument("--decode-tokens", type=int, default=d.decode_tokens, help="tokens each sequence decodes in the timing")
    add_engine_args(p)
    p.set_defaults(func=cmd_qualify)
    return p


def configurations(baseline: dict, candidates: dict[str, dict], oracle: dict):
    from qsaserve.qualify.oracle import ORACLE_ARGS
    from qsaserve.qualify.runner import Configuration

    out = [Configuration("baseline", "baseline", baseline)]
    out += [Configuration(name, "candidate", over) for name, over in candidates.items()]
    # the oracle keeps the baseline's model (a candidate may load another checkpoint)
    out.append(Configuration("oracle", "oracle", {**{k: v for k, v in baseline.items() if k == "model"}, **ORACLE_ARGS,
                                                  **oracle}))
    return out


def cmd_qualify(args) -> int:
    from qsaserve.engine_args import engine_config_from_args
    from qsaserve.quant.cli import resolve_model_tag
    from qsaserve.quant.dataset import pydoc_topics, text_file
    from qsaserve.qualify.report import build_report, summary_lines, write_report
    from qsaserve.qualify.rules import Rules
    from qsaserve.qualify.runner import Settings, run

    t0 = time.perf_counter()
    resolve_model_tag(args)
    defaults = EngineConfig()
    config = engine_config_from_args(args)
    common = {k: v for k, v in config.__dict__.items() if v != getattr(defaults, k)}
    if common.get(SPEC) is not None:  # --speculative-config JSON: every configuration speculates (the oracle not)
        common[SPEC] = _speculative_config(args.speculative_config, "speculative_config")
    candidates = dict(parse_candidate(spec) for spec in args.candidate)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    rules = Rules.parse(args.rule)
    settings = Settings(num_tokens=args.num_tokens, window=args.window, gate_tokens=args.gate_tokens,
                        gate_long_tokens=args.gate_long_tokens, oracle_seeds=tuple(range(args.oracle_seeds)),
                        oracle_tokens=args.oracle_tokens, arithmetic_items=args.arithmetic_items,
                        long_items=args.long_items, task_temperature=args.task_temperature,
                        task_files=[t for t in args.tasks if not t.startswith("lmeval:")],
                        lmeval_tasks=[t.removeprefix("lmeval:") for t in args.tasks if t.startswith("lmeval:")],
                        prefill_tokens=args.prefill_tokens, decode_batch=args.decode_batch, decode_tokens=args.decode_tokens,
                        strict_provenance=args.strict_provenance)
    dataset = text_file(args.dataset) if args.dataset else pydoc_topics("evaluation")
    configs = configurations(parse_overrides(args.baseline, "baseline"), candidates, parse_overrides(args.oracle, "oracle"))
    body = run(common, configs, dataset, stages, os.path.join(args.output, ".scratch"), settings=settings, rules=rules)
    meta = {
        # as typed: `qsaserve qualify ...` (also when started as `python -m qsaserve.cli`)
        "command": shlex.join(["qsaserve", *sys.argv[sys.argv.index("qualify"):]]) if "qualify" in sys.argv else None,
        "date": datetime.date.today().isoformat(),
        "model": config.model,
        "common_engine_args": common,
        "stages": stages,
        "rules": rules.as_dict(),
        "settings": {k: v for k, v in settings.__dict__.items()},
        "wall_time_s": round(time.perf_counter() - t0, 1),
        "cpu_threads": _threads(),
    }
    report = build_report(body, meta)
    json_path, html_path = write_report(report, args.output)
    for line in summary_lines(report):
        print(line)
    print(f"report: {json_path}, {html_path} ({meta['wall_time_s']} s)")
    verdicts = [v["verdict"] for v in report["verdicts"].values()]
    return 1 if "FAIL" in verdicts else 2 if "INCONCLUSIVE" in verdicts else 0


def _threads() -> dict:
    import torch

    return {"torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "cpu_count": os.cpu_count()}
