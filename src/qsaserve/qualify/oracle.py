"""Stage 3, FP64 oracle: how far each configuration is from exact arithmetic.

The oracle is the same engine (same model code, same weights) run in float64 on the CPU by
default (`--oracle KEY=VAL,...` overrides, e.g. `device=cuda`), with float64 KV pages. Its
teacher-forced log-probabilities on a few samples, each drawn with its own seed, are the
reference; every configuration's distance to it is measured on the same samples:
  - KL(oracle || configuration) over the full vocabulary, mean over positions (nats);
  - mean and max |delta logprob| of the actual next token.
The LM head hands back float32 logits (layers/vocab_parallel.py), so the oracle's rows carry a
rounding of ~1e-7 relative, far below the differences a dtype or layout change makes.

Pass rule: KL(oracle || candidate) <= oracle_factor * KL(oracle || baseline), or below
oracle_kl_floor (a distance to exact arithmetic small enough whatever the baseline's). The
baseline's own distance is what a candidate is allowed; a layout change (TP, DCP) should not move
it, a quantized cache may, within the floor.
"""
from __future__ import annotations

import numpy as np

from qsaserve.qualify.logits import LogprobRecord
from qsaserve.qualify.rules import FAIL, PASS, Rules, result
from qsaserve.qualify.teacher_forced import ROWS_PER_CHUNK, _kl

# Engine arguments of the oracle, over the common ones (a candidate's parallel layout is not the
# oracle's: it runs as one rank).
ORACLE_ARGS = {"dtype": "float64", "device": "cpu", "kv_cache_dtype": "auto", "kv_scales": None, "kv_rotation": None,
               "tensor_parallel_size": 1, "decode_context_parallel_size": 1, "enforce_eager": True,
               "speculative_config": None}  # it only teacher-forces: drafts would be verified by nothing


def distance(oracle: LogprobRecord, other: LogprobRecord, window_positions: list[int]) -> dict:
    """Distance of `other` to the oracle, overall and per sample (window)."""
    if oracle.num_positions != other.num_positions or not np.array_equal(oracle.targets, other.targets):
        raise ValueError("oracle and configuration records cover different token streams")
    a, b = oracle.rows(), other.rows()
    n = oracle.num_positions
    kl = np.empty(n)
    dlp = np.empty(n)
    for s in range(0, n, ROWS_PER_CHUNK):
        e = min(s + ROWS_PER_CHUNK, n)
        la, lb = a[s:e].astype(np.float64), b[s:e].astype(np.float64)
        idx = np.arange(e - s), oracle.targets[s:e]
        kl[s:e] = _kl(la, lb)
        dlp[s:e] = np.abs(lb[idx] - la[idx])
    per_sample, start = [], 0
    for count in window_positions:
        sl = slice(start, start + count)
        per_sample.append({"kl_mean": float(kl[sl].mean()), "mean_abs_dlogprob": float(dlp[sl].mean()),
                           "max_abs_dlogprob": float(dlp[sl].max())})
        start += count
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "mean_abs_dlogprob": float(dlp.mean()),
            "max_abs_dlogprob": float(dlp.max()), "per_sample": per_sample}


def judge(base: dict, cand: dict, rules: Rules) -> dict:
    b, c = base["kl_mean"], cand["kl_mean"]
    allowed = rules.oracle_factor * b
    ratio = c / b if b > 0 else (1.0 if c == 0 else float("inf"))
    farther = sum(cs["kl_mean"] > bs["kl_mean"] for bs, cs in zip(base["per_sample"], cand["per_sample"]))
    detail = (f"KL to the FP64 oracle {c:.3g} nats vs baseline {b:.3g} (x{ratio:.2f}; farther on {farther} of "
              f"{len(cand['per_sample'])} samples)")
    if not np.isfinite(c):
        return result(FAIL, [f"{detail}: not finite"], ratio=ratio)
    if c <= allowed:
        return result(PASS, [f"{detail} <= x{rules.oracle_factor:g}"], ratio=ratio)
    if c <= rules.oracle_kl_floor:
        return result(PASS, [f"{detail} > x{rules.oracle_factor:g} but under the floor {rules.oracle_kl_floor:g}"],
                      ratio=ratio)
    return result(FAIL, [f"{detail}: beyond x{rules.oracle_factor:g} and the floor {rules.oracle_kl_floor:g}"],
                  ratio=ratio)
