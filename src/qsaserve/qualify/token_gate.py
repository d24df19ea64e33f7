"""Stage 2, fixed-prompt token gate: greedy continuations of the built-in prompts (inputs.py:
short, code, a long prompt with a marker in the middle, a prefix run twice with a changed suffix,
the same prompt twice), one request at a time in that order, so the second of each pair can hit
the prefix cache where the configuration has one.

Per prompt the candidate's tokens are identical to the baseline's, or the report gives the first
divergent position with both configurations' top-1 minus top-2 margin there and the baseline's
logprob of the candidate's token (when in its top LOGPROBS).

Speculation. A sequence that asks for logprobs never drafts, so a configuration that speculates
runs each prompt twice: first as served (no logprobs: drafted and verified, with its spec-decode
counters read around the request, acceptance.py), whose tokens are the ones compared and whose
cached-token count is reported; then with logprobs (not drafting), which gives the top-5 at each
position and, compared with the served tokens, shows whether speculation changed a greedy token
of its own configuration. Served first, so that a later prompt hitting the prefix cache finds
blocks computed by a drafting request (without prefix caching an MTP head writes no pages for a
request that never drafts, docs/speculative.md).

Pass rule: FAIL when a divergence happens where the baseline's margin was >= gate_margin (a
confident choice changed), when a configuration gives the same prompt two different
continuations, or when a configuration's speculative tokens leave its own non-speculative ones
where those led by >= gate_margin; divergences at near-ties are reported, not failed. With both
configurations speculating alike, the acceptance rule of acceptance.py joins (the worse status
wins).
"""
from __future__ import annotations

from qsaserve.qualify import acceptance
from qsaserve.qualify.rules import FAIL, INCONCLUSIVE, PASS, Rules, result
from qsaserve.sampling_params import SamplingParams

LOGPROBS = 5


def collect(llm, prompts, new_tokens: int) -> dict:
    scored = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=LOGPROBS)
    served = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    spec = acceptance.config_of(llm)
    out = {}
    for prompt in prompts:
        request = [{"prompt_token_ids": prompt.ids}]
        rec = {"prompt_tokens": len(prompt.ids)}
        if spec is not None:  # as served: drafts verified (a request with logprobs would not draft)
            before = acceptance.snapshot(llm)
            res = llm.generate(request, served, use_tqdm=False)[0]
            rec["speculation"] = acceptance.delta(before, acceptance.snapshot(llm))
            rec.update(tokens=list(res.outputs[0].token_ids), cached_tokens=res.num_cached_tokens or 0,
                       finish_reason=res.outputs[0].finish_reason)
        res = llm.generate(request, scored, use_tqdm=False)[0]
        c = res.outputs[0]
        steps = [sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda kv: -kv[1])[:LOGPROBS]
                 for entry in (c.logprobs or [])]
        rec["top"] = steps
        if spec is None:
            rec.update(tokens=list(c.token_ids), cached_tokens=res.num_cached_tokens or 0, finish_reason=c.finish_reason)
        else:
            rec["unspeculated_tokens"] = list(c.token_ids)
        out[prompt.name] = rec
    speculation = None
    if spec is not None:
        speculation = {"config": spec, "total": acceptance.total([r["speculation"] for r in out.values()])}
    return {"prompts": out, "speculation": speculation}


def _first_difference(a: list, b: list) -> int | None:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    return first


def _margin(top: list) -> float:
    return top[0][1] - top[1][1] if len(top) > 1 else float("inf")


def compare(base: dict, cand: dict) -> dict:
    rows = {}
    for name, b in base["prompts"].items():
        c = cand["prompts"][name]
        first = _first_difference(b["tokens"], c["tokens"])
        row = {"identical": first is None, "tokens": len(b["tokens"]), "prompt_tokens": b["prompt_tokens"],
               "baseline_cached_tokens": b["cached_tokens"], "candidate_cached_tokens": c["cached_tokens"]}
        for side, rec in (("baseline", b), ("candidate", c)):
            if rec.get("speculation") is not None:
                row[f"{side}_acceptance_length"] = rec["speculation"]["acceptance_length"]
        if first is not None:
            btop = b["top"][first] if first < len(b["top"]) else []
            ctop = c["top"][first] if first < len(c["top"]) else []
            cand_tok = c["tokens"][first] if first < len(c["tokens"]) else None
            row.update(first_divergence=first, baseline_token=b["tokens"][first] if first < len(b["tokens"]) else None,
                       candidate_token=cand_tok, baseline_margin=_margin(btop), candidate_margin=_margin(ctop),
                       baseline_logprob_of_candidate_token=dict(btop).get(cand_tok))
        rows[name] = row
    return rows


def self_consistency(rec: dict) -> list[str]:
    """Pairs of the same prompt that a configuration continued differently."""
    p = rec["prompts"]
    if "repeat_first" in p and p["repeat_first"]["tokens"] != p["repeat_second"]["tokens"]:
        return ["the same prompt run twice gave different tokens"]
    return []


def speculation_changes(rec: dict, rules: Rules) -> tuple[list[str], list[str]]:
    """Where a configuration's served (speculative) tokens leave its own non-speculative ones:
    (confident changes, near-tie changes), each as text. Greedy speculation is exact, so the first
    list must be empty; the second is arithmetic noise (a verify's rows computed together)."""
    confident, near = [], []
    for name, r in rec["prompts"].items():
        if "unspeculated_tokens" not in r:
            continue
        first = _first_difference(r["unspeculated_tokens"], r["tokens"])
        if first is None:
            continue
        margin = _margin(r["top"][first]) if first < len(r["top"]) else float("inf")
        text = f"{name}: speculation changed token {first}, where the run without drafts led by {margin:.3f} nats"
        (confident if margin >= rules.gate_margin else near).append(text)
    return confident, near


def judge(rows: dict, base: dict, cand: dict, rules: Rules) -> dict:
    reasons = []
    for name, row in rows.items():
        if not row["identical"] and row["baseline_margin"] >= rules.gate_margin:
            reasons.append(f"{name}: diverges at token {row['first_divergence']} where the baseline led by "
                           f"{row['baseline_margin']:.3f} nats (>= {rules.gate_margin:g})")
    reasons += [f"candidate: {r}" for r in self_consistency(cand)]
    reasons += [f"baseline: {r}" for r in self_consistency(base)]
    near = [f"{n} at token {r['first_divergence']} (baseline margin {r['baseline_margin']:.3f})"
            for n, r in rows.items() if not r["identical"]]
    for side, rec in (("candidate", cand), ("baseline", base)):
        confident, ties = speculation_changes(rec, rules)
        reasons += [f"{side}: {r} (>= {rules.gate_margin:g})" for r in confident]
        near += [f"{side} {r}" for r in ties]
    acc = acceptance.judge(base, cand, [n for n, r in rows.items() if r["identical"]], rules)
    extra = {"speculation": acc["summary"], "acceptance": {k: v for k, v in acc.items() if k not in ("summary",)}}
    if reasons:
        return result(FAIL, reasons + (acc["reasons"] if acc["status"] == FAIL else []), **extra)
    identical = sum(r["identical"] for r in rows.values())
    text = f"{identical} of {len(rows)} prompts identical" + (f"; near-tie divergences: {', '.join(near)}" if near else "")
    if acc["status"] in (FAIL, INCONCLUSIVE):
        return result(acc["status"], acc["reasons"] + [text], **extra)
    return result(PASS, [text] + acc["reasons"], **extra)
