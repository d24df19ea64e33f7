"""Stage 6, capacity and speed at the same memory budget.

Every configuration gets the same KV memory (the common --kv-cache-memory or
--gpu-memory-utilization); the report gives per configuration the KV budget, bytes per token, the
KV tokens its block pool holds (what the engine allocated: an MTP draft head's pages in every
block and the state rows speculation keeps come out of the same budget, and the report says how
many bytes went there), concurrent max_model_len requests, and two timings through the public
API: prefill tok/s (one prompt, one output token) and decode tok/s (a batch of short prompts,
output tokens beyond the first over the time beyond a one-token run; with speculation the
requests draft and verify as served, and the acceptance over the timed runs is recorded). Each
timing is the best of REPEATS after one warm-up, every run on text not seen before (a prefix
cache would otherwise skip the prefill being timed).

Pass rule: FAIL when the candidate holds fewer than kv_tokens_ratio_min x the baseline's KV
tokens, or its prefill or decode tok/s is below speed_ratio_min x the baseline's; INCONCLUSIVE
when the two KV budgets differ (no longer the same memory).
"""
from __future__ import annotations

import time

from qsaserve.cache.kv_cache import usable_blocks
from qsaserve.qualify import acceptance
from qsaserve.qualify.acceptance import describe
from qsaserve.qualify.rules import FAIL, INCONCLUSIVE, PASS, Rules, result
from qsaserve.sampling_params import SamplingParams

REPEATS = 2


def _best(fn) -> float:
    """fn(run): one timed call on inputs of its own for each run number."""
    fn(0)  # warm-up
    return min(_timed(fn, run) for run in range(1, REPEATS + 1))


def _timed(fn, run: int) -> float:
    t0 = time.perf_counter()
    fn(run)
    return time.perf_counter() - t0


def collect(llm, corpus, *, prefill_tokens: int, decode_batch: int, decode_tokens: int) -> dict:
    engine = llm.engine
    ex = engine.executor
    spec = ex.kv_spec
    usable = usable_blocks(ex.num_kv_blocks)
    at_budget, _ = ex.capacity(engine.max_model_len)  # the K/V pages alone at the whole budget
    n = min(prefill_tokens, engine.max_model_len - 2)
    stride = max(len(corpus.ids) // (2 * REPEATS + 3), 1)

    def long_prompt(run: int):
        return [{"prompt_token_ids": corpus.filler(n, offset=(run * stride) % len(corpus.ids))}]

    def short(run: int):
        base = (run * stride + len(corpus.ids) // 2) % len(corpus.ids)
        return [{"prompt_token_ids": corpus.filler(16, offset=(base + 97 * i) % len(corpus.ids))}
                for i in range(decode_batch)]

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=decode_tokens + 1, ignore_eos=True)
    prefill_s = _best(lambda run: llm.generate(long_prompt(run), one, use_tqdm=False))
    first_s = _best(lambda run: llm.generate(short(run), one, use_tqdm=False))
    before = acceptance.snapshot(llm)
    total_s = _best(lambda run: llm.generate(short(run + REPEATS + 1), many, use_tqdm=False))
    decode_s = max(total_s - first_s, 1e-9)
    return {
        "kv_budget_bytes": int(ex.kv_budget_bytes),
        "kv_bytes_per_token": spec.bytes_per_token,
        "kv_cache_dtype": ex.kv_quant.name,
        "kv_tokens": usable * ex.block_size,
        "kv_tokens_pages_only": at_budget.tokens,
        # the budget not in K/V pages: the MTP head's pages, state snapshot rows (prefix cache, speculation)
        "budget_outside_kv_pages_bytes": int(ex.kv_budget_bytes) - ex.num_kv_blocks * spec.bytes_per_block,
        "mtp_head_bytes": int(ex.memory_plan().get("mtp", 0)),
        "max_len_requests": usable / spec.blocks_for(engine.max_model_len),
        "max_model_len": engine.max_model_len,
        "prefill_tokens": n,
        "prefill_tok_s": n / prefill_s,
        "decode_batch": decode_batch,
        "decode_tokens": decode_tokens,
        "decode_tok_s": decode_batch * decode_tokens / decode_s,
        "speculative_config": acceptance.config_of(llm),
        # warm-up and both timed decode runs (max_tokens=1 runs never draft)
        "decode_acceptance": acceptance.delta(before, acceptance.snapshot(llm)),
        "device": str(ex.device),
    }


def judge(base: dict, cand: dict, rules: Rules) -> dict:
    ratio = cand["kv_tokens"] / max(base["kv_tokens"], 1)
    kv = f"KV tokens {cand['kv_tokens']} vs {base['kv_tokens']} (x{ratio:.2f})"
    speeds = {k: cand[k] / base[k] for k in ("prefill_tok_s", "decode_tok_s")}
    sp = ", ".join(f"{k.removesuffix('_tok_s')} x{v:.2f}" for k, v in speeds.items())
    if cand["kv_budget_bytes"] != base["kv_budget_bytes"]:
        return result(INCONCLUSIVE, [f"KV budgets differ ({cand['kv_budget_bytes']} vs {base['kv_budget_bytes']} bytes): "
                                     "not the same memory; set --kv-cache-memory"], speed_ratios=speeds)
    reasons = []
    if ratio < rules.kv_tokens_ratio_min:
        why = ""
        if cand.get("mtp_head_bytes"):
            why = (f"; the MTP head's pages take {cand['mtp_head_bytes'] / 2**20:.1f} MiB of the budget "
                   f"({cand.get('budget_outside_kv_pages_bytes', 0) / 2**20:.1f} MiB outside the K/V pages in all: "
                   "accept a stated loss with --rule kv_tokens_ratio_min=...)")
        reasons.append(f"fewer {kv} (< x{rules.kv_tokens_ratio_min:g}){why}")
    reasons += [f"{k.removesuffix('_tok_s')} x{v:.2f} of the baseline's speed (< {rules.speed_ratio_min:g})"
                for k, v in speeds.items() if v < rules.speed_ratio_min]
    acc = [f"{side} decodes with {describe(r['speculative_config'])}, acceptance length "
           f"{r['decode_acceptance']['acceptance_length']:.3f} in the timed runs"
           for side, r in (("baseline", base), ("candidate", cand)) if r.get("decode_acceptance")]
    if reasons:
        return result(FAIL, reasons + acc, speed_ratios=speeds)
    return result(PASS, [f"{kv}; {sp}"] + acc, speed_ratios=speeds)
