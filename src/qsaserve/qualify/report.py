"""The report: DIR/report.json (verdicts first, then every stage's numbers and every
configuration's records) and DIR/report.html (html.py: the same, with tables and plots)."""
from __future__ import annotations

import json
import math
import os

import numpy as np

from qsaserve.qualify.logits import LogprobRecord
from qsaserve.qualify.verdict import verdicts


def _clean(obj):
    """JSON-safe: numpy scalars and arrays to Python, LogprobRecords to their summaries, keys
    starting with "_" (per-position arrays kept for the plots) dropped, inf/NaN as strings."""
    if isinstance(obj, LogprobRecord):
        return obj.summary()
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items() if not str(k).startswith("_")}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _clean(obj.tolist())
    if isinstance(obj, np.generic):
        return _clean(obj.item())
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


def build_report(body: dict, meta: dict) -> dict:
    """body: runner.run's result; meta: command, model, common engine args, rules, settings..."""
    return {"verdicts": verdicts(body["results"]), **meta, "inputs": body["inputs"], "results": body["results"],
            "configurations": body["records"], "timings_s": body["timings_s"]}


def write_report(report: dict, directory: str) -> tuple[str, str]:
    from qsaserve.qualify.html import render_html

    os.makedirs(directory, exist_ok=True)
    json_path, html_path = os.path.join(directory, "report.json"), os.path.join(directory, "report.html")
    clean = _clean(report)
    with open(json_path, "w", encoding="utf-8") as fh:
        json.dump(clean, fh, indent=1)
        fh.write("\n")
    with open(html_path, "w", encoding="utf-8") as fh:
        fh.write(render_html(report, clean))
    return json_path, html_path


def summary_lines(report: dict) -> list[str]:
    """What the command prints: one line per candidate, then its reasons."""
    lines = []
    for name, v in report["verdicts"].items():
        lines.append(f"{name}: {v['verdict']}" + (f" (caught by {', '.join(v['failed_stages'])})" if v["failed_stages"] else ""))
        lines += [f"  - {r}" for r in v["reasons"]]
    return lines
