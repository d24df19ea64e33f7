"""Stage 2, fixed-prompt token gate: greedy continuations of the built-in prompts (inputs.py:
short, code, a long prompt with a marker in the middle, a prefix run twice with a changed suffix,
the same prompt twice), one request at a time in that order, so the second of each pair can hit
the prefix cache where the configuration has one.

Per prompt the candidate's tokens are identical to the baseline's, or the report gives the first
divergent position with both configurations' top-1 minus top-2 margin there and the baseline's
logprob of the candidate's token (when in its top LOGPROBS).

Pass rule: FAIL when a divergence happens where the baseline's margin was >= gate_margin (a
confident choice changed), or when a configuration gives the same prompt two different
continuations; divergences at near-ties are reported, not failed. Speculative decoding would add
acceptance per position against the baseline; no configuration of this engine speculates yet, and
the report says so instead of a number.
"""
from __future__ import annotations

from qsaserve.qualify.rules import FAIL, PASS, Rules, result
from qsaserve.sampling_params import SamplingParams

LOGPROBS = 5


def collect(llm, prompts, new_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=LOGPROBS)
    out = {}
    for prompt in prompts:
        res = llm.generate([{"prompt_token_ids": prompt.ids}], params, use_tqdm=False)[0]
        c = res.outputs[0]
        steps = [sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda kv: -kv[1])[:LOGPROBS]
                 for entry in (c.logprobs or [])]
        out[prompt.name] = {"prompt_tokens": len(prompt.ids), "tokens": list(c.token_ids), "top": steps,
                            "cached_tokens": res.num_cached_tokens or 0, "finish_reason": c.finish_reason}
    return {"prompts": out, "speculation": None}


def _margin(top: list) -> float:
    return top[0][1] - top[1][1] if len(top) > 1 else float("inf")


def compare(base: dict, cand: dict) -> dict:
    rows = {}
    for name, b in base["prompts"].items():
        c = cand["prompts"][name]
        first = next((i for i, (x, y) in enumerate(zip(b["tokens"], c["tokens"])) if x != y), None)
        if first is None and len(b["tokens"]) != len(c["tokens"]):
            first = min(len(b["tokens"]), len(c["tokens"]))
        row = {"identical": first is None, "tokens": len(b["tokens"]), "prompt_tokens": b["prompt_tokens"],
               "baseline_cached_tokens": b["cached_tokens"], "candidate_cached_tokens": c["cached_tokens"]}
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


def judge(rows: dict, base: dict, cand: dict, rules: Rules) -> dict:
    reasons = []
    for name, row in rows.items():
        if not row["identical"] and row["baseline_margin"] >= rules.gate_margin:
            reasons.append(f"{name}: diverges at token {row['first_divergence']} where the baseline led by "
                           f"{row['baseline_margin']:.3f} nats (>= {rules.gate_margin:g})")
    reasons += [f"candidate: {r}" for r in self_consistency(cand)]
    reasons += [f"baseline: {r}" for r in self_consistency(base)]
    identical = sum(r["identical"] for r in rows.values())
    speculation = "no speculative decoding in either configuration: acceptance per position not measured"
    if reasons:
        return result(FAIL, reasons, speculation=speculation)
    near = [f"{n} at token {r['first_divergence']} (baseline margin {r['baseline_margin']:.3f})"
            for n, r in rows.items() if not r["identical"]]
    text = f"{identical} of {len(rows)} prompts identical" + (f"; near-tie divergences: {', '.join(near)}" if near else "")
    return result(PASS, [text], speculation=speculation)
