"""A/B of two source trees on the same `qsaserve bench` commands, in one run on one device.

    python benchmarks/bench_tree_ab.py --baseline-src .ab/base/src --baseline-commit caef521 \
        --rounds 2 --out ab.json -- \
        "latency qwen4exp-small --load-format dummy --max-model-len 9000 --batch-sizes 1 ..." \
        "throughput llama-1b --load-format dummy --max-model-len 4096"

Each command runs once per tree per round, in a fresh process, the order of the two trees
reversed every other round (a configuration's timing moves with its position in a run). The
candidate is this checkout's `src/` (or --candidate-src). Prints one JSON document: every run's
report, the per-command medians of the headline figures, and candidate/baseline ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def headline(report: dict) -> dict[str, float]:
    """The figures compared: decode tok/s per batch size and TTFT per prompt length (latency), output
    tok/s of both passes (throughput)."""
    out: dict[str, float] = {}
    for row in report.get("decode", []):
        out[f"decode_tok_s_b{row['batch_size']}_ctx{row['context']}"] = row["tok_s"]
        prof = row.get("profile") or {}
        if "device_ms" in prof:
            out[f"decode_device_ms_b{row['batch_size']}"] = prof["device_ms"]
    for row in report.get("ttft", []):
        out[f"ttft_ms_p{row['prompt_len']}"] = row["ttft_ms"]
    result = report.get("results") or {}
    for key in ("output_tok_s", "repeat_output_tok_s"):
        if key in result:
            out[key] = result[key]
    return out


def run_once(src: Path, commit: str, command: str, timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep),
               QSASERVE_COMMIT=commit)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "qsaserve.cli", "bench", *shlex.split(command)], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        return {"rc": proc.returncode, "seconds": round(elapsed, 1), "stderr_tail": proc.stderr[-3000:]}
    report = json.loads(proc.stdout)
    return {"rc": 0, "seconds": round(elapsed, 1), "headline": headline(report), "report": report}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-src", required=True, type=Path, help="the baseline tree's src/ folder")
    parser.add_argument("--baseline-commit", required=True, help="the commit the baseline tree was exported from")
    parser.add_argument("--candidate-src", type=Path, default=ROOT / "src")
    parser.add_argument("--candidate-commit", default=os.environ.get("QSASERVE_COMMIT"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one bench process may take")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("commands", nargs="+", help="`qsaserve bench` arguments, one quoted string per command")
    args = parser.parse_args()
    if args.candidate_commit is None:
        args.candidate_commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                               cwd=ROOT).stdout.strip() or "unknown"
    trees = {"baseline": (args.baseline_src.resolve(), args.baseline_commit),
             "candidate": (args.candidate_src.resolve(), args.candidate_commit)}
    runs: list[dict] = []
    for command in args.commands:
        for r in range(args.rounds):
            order = ["baseline", "candidate"] if r % 2 == 0 else ["candidate", "baseline"]
            for name in order:
                src, commit = trees[name]
                result = run_once(src, commit, command, args.timeout)
                runs.append({"command": command, "round": r, "tree": name, "commit": commit, **result})
                print(json.dumps({k: runs[-1][k] for k in ("command", "round", "tree", "rc", "seconds")}
                                 | {"headline": runs[-1].get("headline")}), file=sys.stderr, flush=True)
    summary = []
    for command in args.commands:
        medians = {}
        for name in trees:
            values: dict[str, list[float]] = {}
            for run in runs:
                if run["command"] == command and run["tree"] == name and run["rc"] == 0:
                    for key, value in run["headline"].items():
                        values.setdefault(key, []).append(value)
            medians[name] = {key: statistics.median(v) for key, v in values.items()}
        ratios = {key: round(medians["candidate"][key] / medians["baseline"][key], 4)
                  for key in medians["baseline"] if key in medians["candidate"] and medians["baseline"][key]}
        summary.append({"command": command, "median": medians, "candidate_over_baseline": ratios})
    doc = {"bench": "tree_ab", "baseline_commit": args.baseline_commit, "candidate_commit": args.candidate_commit,
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rounds": args.rounds,
           "summary": summary, "runs": runs}
    text = json.dumps(doc, indent=1)
    if args.out is not None:
        args.out.write_text(text)
    print(json.dumps(summary, indent=1))
    return 0 if all(run["rc"] == 0 for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
