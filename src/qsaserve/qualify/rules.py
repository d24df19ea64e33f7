"""The pass rules' numbers, in one place (docs/qualify.md explains each; `--rule KEY=VALUE` sets
them). A stage's result is PASS, FAIL or INCONCLUSIVE (evidence missing or too weak either way),
or NOT_RUN when it was not selected or cannot run on this model; the verdict is built from them
(verdict.py)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from qsaserve.errors import InvalidRequestError

PASS, FAIL, INCONCLUSIVE, NOT_RUN = "PASS", "FAIL", "INCONCLUSIVE", "NOT_RUN"


@dataclass
class Rules:
    # 1. teacher-forced distribution (against the baseline)
    tf_kl_mean_max: float = 0.01  # nats; README's calibrated FP8 KV on SmolLM2: 2.1e-3, unit scales 9.2e-3
    tf_ppl_change_max_pct: float = 1.0  # |candidate / baseline perplexity - 1|
    wide_margin: float = 1.0  # nats: a baseline top-1 this far ahead of its top-2 is a confident choice
    tf_wide_flip_rate_max: float = 0.001  # share of positions whose confident baseline top-1 the candidate flips
    # 2. fixed-prompt token gate: a greedy divergence where the baseline was confident fails
    gate_margin: float = 1.0  # nats (baseline top-1 minus top-2 at the first divergent token)
    # both speculating alike: the candidate's acceptance length (1 + accepted / verifies) on the
    # prompts continued identically may fall short of the baseline's by this many tokens per verify
    gate_acceptance_length_drop_max: float = 0.1
    # 3. FP64 oracle: KL(oracle || candidate) <= factor * KL(oracle || baseline), or below the floor
    oracle_factor: float = 1.5
    oracle_kl_floor: float = 0.005  # nats: a distance to exact arithmetic small enough whatever the baseline's
    # 4. paired task screen
    task_margin: float = 0.05  # equivalence margin on the mean score difference (score units: 0..1)
    task_alpha: float = 0.05  # TOST and McNemar level
    # 6. capacity and speed at the same memory budget
    speed_ratio_min: float = 0.5  # candidate tok/s over baseline tok/s, prefill and decode
    # candidate KV tokens over the baseline's; below 1 accepts a stated loss (e.g. an MTP head's pages)
    kv_tokens_ratio_min: float = 1.0

    @classmethod
    def parse(cls, items: list[str] | None) -> "Rules":
        """From "key=value" strings (repeatable `--rule`)."""
        rules = cls()
        names = {f.name for f in fields(cls)}
        for item in items or []:
            key, sep, value = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in names:
                raise InvalidRequestError("rule", f"expected KEY=VALUE with KEY one of {', '.join(sorted(names))}; "
                                          f"got {item!r}")
            try:
                setattr(rules, key, float(value))
            except ValueError:
                raise InvalidRequestError("rule", f"{key} must be a number, got {value!r}") from None
        return rules

    def as_dict(self) -> dict:
        return asdict(self)


def result(status: str, reasons: list[str], **metrics) -> dict:
    """One stage's outcome for one candidate."""
    return {"status": status, "reasons": reasons, **metrics}


def worst(statuses: list[str]) -> str:
    """FAIL over INCONCLUSIVE over PASS (NOT_RUN ignored; PASS when nothing ran)."""
    ran = [s for s in statuses if s != NOT_RUN]
    if FAIL in ran:
        return FAIL
    if INCONCLUSIVE in ran:
        return INCONCLUSIVE
    return PASS
