"""Stage 8, the verdict per candidate: FAIL when any stage that ran failed (naming the stages
that caught it), else INCONCLUSIVE when any stage could not decide, else PASS. Stages not run
are listed, never counted as passed: a verdict over fewer stages proves less, and says which."""
from __future__ import annotations

from qsaserve.qualify.rules import FAIL, INCONCLUSIVE, NOT_RUN, worst

STAGE_TITLES = {
    "teacher_forced": "1. Teacher-forced distribution",
    "token_gate": "2. Fixed-prompt token gate",
    "oracle": "3. FP64 oracle",
    "tasks": "4. Paired task screen",
    "health": "5. Health",
    "capacity": "6. Capacity and speed",
    "provenance": "7. Provenance",
}


def verdict(stages: dict[str, dict]) -> dict:
    statuses = {name: st["status"] for name, st in stages.items()}
    overall = worst(list(statuses.values()))
    failed = [n for n, s in statuses.items() if s == FAIL]
    undecided = [n for n, s in statuses.items() if s == INCONCLUSIVE]
    reasons = [f"{STAGE_TITLES.get(n, n)}: {r}" for n in failed + undecided for r in stages[n]["reasons"]]
    return {
        "verdict": overall,
        "failed_stages": failed,
        "inconclusive_stages": undecided,
        "not_run": [n for n, s in statuses.items() if s == NOT_RUN],
        "stages": statuses,
        "reasons": reasons or [f"every stage that ran passed ({', '.join(n for n, s in statuses.items() if s != NOT_RUN)})"],
    }


def verdicts(results: dict) -> dict:
    return {name: verdict(stages) for name, stages in results["candidates"].items()}
