"""Stage 5, health of one configuration (judged on its own, not against the baseline):
  - a NaN/inf scan of the full logits of every teacher-forced position (stages 1 and 3 record
    the count per row while scoring, logits.record_logprobs);
  - the exact boundary: a prompt of max_model_len - 1 tokens generating one token, whose logprob
    must be finite;
  - a prompt of max_model_len tokens must be refused cleanly (InvalidRequestError on submission)
    and the engine must go on serving afterwards.

Pass rule: FAIL on any non-finite logit, a non-finite or missing boundary logprob, an accepted
over-length request, or an engine that cannot serve after the refusal.
"""
from __future__ import annotations

import math

from qsaserve.errors import InvalidRequestError
from qsaserve.qualify.rules import FAIL, PASS, result
from qsaserve.sampling_params import SamplingParams


def _boundary(llm, corpus) -> dict:
    n = llm.engine.max_model_len - 1
    ids = corpus.filler(n)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    lp = out.logprobs[0][out.token_ids[0]].logprob if out.logprobs and out.token_ids else None
    return {"prompt_tokens": n, "generated": len(out.token_ids), "logprob": lp, "finish_reason": out.finish_reason,
            "finite": lp is not None and math.isfinite(lp)}


def _over_length(llm, corpus) -> dict:
    n = llm.engine.max_model_len
    try:
        llm.generate([{"prompt_token_ids": corpus.filler(n)}], SamplingParams(max_tokens=1), use_tqdm=False)
    except InvalidRequestError as e:
        refused, message = True, f"{e.param}: {e}" if getattr(e, "param", None) else str(e)
    else:
        refused, message = False, "accepted"
    after = llm.generate([{"prompt_token_ids": corpus.filler(4)}], SamplingParams(max_tokens=1, temperature=0.0),
                         use_tqdm=False)[0].outputs[0]
    return {"prompt_tokens": n, "refused": refused, "message": message,
            "serves_after": len(after.token_ids) == 1 and after.finish_reason != "error"}


def collect(llm, corpus) -> dict:
    return {"boundary": _boundary(llm, corpus), "over_length": _over_length(llm, corpus)}


def judge(rec: dict, scans: dict[str, dict]) -> dict:
    """rec: collect()'s record; scans: {"teacher_forced": LogprobRecord.summary(), ...} of this
    configuration."""
    reasons = []
    for what, s in scans.items():
        if s["positions_with_nonfinite_logits"]:
            reasons.append(f"{what}: {s['positions_with_nonfinite_logits']} of {s['positions']} positions have NaN/inf "
                           f"logits ({s['nonfinite_logits']} values)")
    b, o = rec.get("boundary"), rec.get("over_length")
    if b is not None and not b["finite"]:
        reasons.append(f"boundary: a {b['prompt_tokens']}-token prompt gave logprob {b['logprob']} "
                       f"(finish {b['finish_reason']})")
    if o is not None and not o["refused"]:
        reasons.append(f"a {o['prompt_tokens']}-token prompt (= max_model_len) was accepted")
    if o is not None and not o["serves_after"]:
        reasons.append("the engine could not serve a request after refusing the over-length one")
    scanned = sum(s["positions"] for s in scans.values())
    if reasons:
        return result(FAIL, reasons)
    text = f"{scanned} positions scanned, all logits finite"
    if b is not None:
        text += f"; {b['prompt_tokens']}-token prompt -> logprob {b['logprob']:.3f}; {o['prompt_tokens']} tokens refused"
    return result(PASS, [text])
