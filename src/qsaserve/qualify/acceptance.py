"""Speculative decoding's acceptance, as stage 2 (token gate) and stage 6 (capacity) measure it:
the engine's spec-decode counters (engine/spec_decode.SpecDecodeStats) read before and after each
request, so every request gets its own drafted / accepted / verify counts and accepted drafts
per position; sums over requests give the totals.

Definitions (vLLM's, as the engine's /metrics): a verify is one sequence's drafts checked in one
step; acceptance rate = accepted / drafted; acceptance length = 1 + accepted / verifies (tokens a
verify emits); the acceptance rate at position i = verifies that accepted draft i / verifies.

Pass rule (stage 2), only when baseline and candidate speculate with the same speculative_config
(method, k and, for n-gram, the lookup lengths): over the prompts whose continuations are
identical on both sides (the same text verified), FAIL when the candidate's acceptance length is
below the baseline's by more than gate_acceptance_length_drop_max; INCONCLUSIVE when no prompt is
identical or the baseline verified no draft there. When only one side speculates, or their
configs differ, acceptance is reported, not judged.
"""
from __future__ import annotations

from qsaserve.qualify.rules import FAIL, INCONCLUSIVE, PASS, Rules

COUNTS = ("drafted", "accepted", "verifies")


def config_of(llm) -> dict | None:
    """The engine's speculative_config as a dict (None: it does not speculate)."""
    spec = llm.engine.config.speculative_config
    return spec.to_dict() if spec is not None else None


def snapshot(llm) -> dict | None:
    """The engine's cumulative counters now (None without speculation)."""
    spec = llm.engine.spec
    if spec is None:
        return None
    st = spec.stats
    return {"drafted": st.drafted, "accepted": st.accepted, "verifies": st.verifies,
            "accepted_per_position": list(st.accepted_per_position)}


def delta(before: dict | None, after: dict | None) -> dict | None:
    """Counters of what ran between two snapshots, with their rates."""
    if before is None or after is None:
        return None
    counts = {k: after[k] - before[k] for k in COUNTS}
    per_pos = [a - b for a, b in zip(after["accepted_per_position"], before["accepted_per_position"], strict=True)]
    return summarize({**counts, "accepted_per_position": per_pos})


def summarize(counts: dict) -> dict:
    """Counts -> counts plus acceptance rate, acceptance length and rate per position (0 with no verify)."""
    v, d = counts["verifies"], counts["drafted"]
    per_pos = list(counts["accepted_per_position"])
    return {**{k: counts[k] for k in COUNTS}, "accepted_per_position": per_pos,
            "acceptance_rate": counts["accepted"] / d if d else 0.0,
            "acceptance_length": 1.0 + counts["accepted"] / v if v else 0.0,
            "acceptance_rate_per_position": [a / v if v else 0.0 for a in per_pos]}


def total(parts: list[dict]) -> dict:
    """The sum of per-request deltas (all of one configuration: the same k)."""
    k = len(parts[0]["accepted_per_position"]) if parts else 0
    counts = {key: sum(p[key] for p in parts) for key in COUNTS}
    counts["accepted_per_position"] = [sum(p["accepted_per_position"][i] for p in parts) for i in range(k)]
    return summarize(counts)


def describe(spec: dict | None) -> str:
    if spec is None:
        return "no speculation"
    lookup = f", lookup {spec['prompt_lookup_min']}..{spec['prompt_lookup_max']}" if spec["method"] == "ngram" else ""
    return f"{spec['method']} k={spec['num_speculative_tokens']}{lookup}"


def _comparable(a: dict, b: dict) -> bool:
    """Same drafter: the batch-size cut-off and the per-step fallback decide when to draft, not
    what a draft is."""
    strip = lambda s: {k: v for k, v in s.items() if k not in ("disable_by_batch_size", "disable_when_slower")}  # noqa: E731
    return strip(a) == strip(b)


def line(name: str, spec: dict | None, s: dict | None) -> str:
    if s is None:
        return f"{name}: {describe(spec)}"
    return (f"{name} ({describe(spec)}): {s['accepted']} of {s['drafted']} drafts accepted in {s['verifies']} verifies, "
            f"acceptance length {s['acceptance_length']:.3f}, per position "
            + " / ".join(f"{r:.2f}" for r in s["acceptance_rate_per_position"]))


def judge(base: dict, cand: dict, identical: list[str], rules: Rules) -> dict:
    """base, cand: the configurations' token-gate records; identical: the prompts both continued alike.
    -> {"status": PASS | FAIL | INCONCLUSIVE | None (not judged), "reasons", "summary", "identical_prompts"}."""
    bs, cs = base.get("speculation"), cand.get("speculation")
    summary = "; ".join(line(n, r["speculation"]["config"] if r.get("speculation") else None,
                              r["speculation"]["total"] if r.get("speculation") else None)
                        for n, r in (("baseline", base), ("candidate", cand)))
    out = {"status": None, "reasons": [], "summary": summary}
    if bs is None and cs is None:
        out["summary"] = "no speculative decoding in either configuration: acceptance not measured"
        return out
    if bs is None or cs is None:
        out["reasons"] = [f"acceptance not compared: only the {'candidate' if bs is None else 'baseline'} speculates"]
        return out
    if not _comparable(bs["config"], cs["config"]):
        out["reasons"] = [f"acceptance not compared: the drafters differ ({describe(bs['config'])} vs "
                          f"{describe(cs['config'])})"]
        return out
    b = total([base["prompts"][p]["speculation"] for p in identical])
    c = total([cand["prompts"][p]["speculation"] for p in identical])
    out.update(identical_prompts=identical, baseline_on_identical=b, candidate_on_identical=c)
    if not identical:
        return {**out, "status": INCONCLUSIVE, "reasons": ["acceptance: no prompt continued identically on both sides, "
                                                             "so no text was verified by both"]}
    for side, counts in (("baseline", b), ("candidate", c)):
        if counts["verifies"] == 0:  # e.g. the per-step fallback kept it from drafting
            return {**out, "status": INCONCLUSIVE, "reasons": [f"acceptance: the {side} verified no draft on the "
                                                                 f"{len(identical)} identical prompts"]}
    drop = b["acceptance_length"] - c["acceptance_length"]
    text = (f"acceptance length on the {len(identical)} identical prompts {c['acceptance_length']:.3f} vs the "
            f"baseline's {b['acceptance_length']:.3f}")
    if drop > rules.gate_acceptance_length_drop_max:
        return {**out, "status": FAIL, "reasons": [f"{text}: lower by {drop:.3f} tokens per verify (> "
                                                     f"{rules.gate_acceptance_length_drop_max:g})"]}
    return {**out, "status": PASS, "reasons": [text]}
