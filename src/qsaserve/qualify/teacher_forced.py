"""Stage 1, teacher-forced distribution: candidate against baseline on one token stream.

Every configuration scores the same windows teacher-forced (logits.record_logprobs). Per
predicted position, over the full vocabulary:
  - NLL of the actual next token (perplexity = exp(mean NLL));
  - KL(baseline || candidate) in nats: mean, percentiles and max (llama.cpp's
    `perplexity --kl-divergence` reports the same);
  - whether the top-1 tokens agree ("same top p" in llama.cpp), and where they do not, how far
    the baseline's own top two were apart there (its top-1 minus top-2 logprob): flips at
    near-ties are the noise any change of arithmetic makes, flips at wide margins are damage.
    MARGIN_EDGES bins both the flips and every position;
  - delta-p: candidate minus baseline probability of the actual next token (RMS, percentiles).
Windows are independent contexts.
"""
from __future__ import annotations

import math

import numpy as np

from qsaserve.qualify.logits import LogprobRecord
from qsaserve.qualify.rules import FAIL, INCONCLUSIVE, PASS, Rules, result
from qsaserve.qualify.stats import percentiles

MARGIN_EDGES = (0.01, 0.05, 0.1, 0.2, 0.5, 1.0)  # nats: bins [0, 0.01), [0.01, 0.05), ..., [1.0, inf)
ROWS_PER_CHUNK = 256
DELTA_P_QUANTILES = (0.001, 0.01, 0.05, 0.1, 0.5, 0.9, 0.95, 0.99, 0.999)


def margin_bins(margins: np.ndarray) -> np.ndarray:
    """Counts of `margins` in the MARGIN_EDGES bins."""
    return np.bincount(np.digitize(margins, MARGIN_EDGES), minlength=len(MARGIN_EDGES) + 1)


def histogram(counts) -> dict:
    names = [f"<{MARGIN_EDGES[0]}"] + [f"{a}-{b}" for a, b in zip(MARGIN_EDGES, MARGIN_EDGES[1:])] + [f">={MARGIN_EDGES[-1]}"]
    return dict(zip(names, [int(c) for c in counts]))


def _kl(lp_ref: np.ndarray, lp: np.ndarray) -> np.ndarray:
    """KL(ref || other) per row, float64; a token the reference gives probability and the other
    gives none makes it inf (not NaN)."""
    p = np.exp(lp_ref)
    with np.errstate(invalid="ignore"):
        terms = np.where(p > 0, p * (lp_ref - lp), 0.0)
    # KL >= 0; the float32 rows' rounding alone can make a near-zero sum come out at -1e-10
    return np.maximum(terms.sum(-1), 0.0)


def compare_records(base: LogprobRecord, cand: LogprobRecord) -> dict:
    """Every stage-1 metric of `cand` against `base` (same windows), plus the per-position KL and
    the baseline's margins for the plots."""
    if base.num_positions != cand.num_positions or not np.array_equal(base.targets, cand.targets):
        raise ValueError("teacher-forced records of different token streams cannot be compared")
    n = base.num_positions
    a, b = base.rows(), cand.rows()
    kl = np.empty(n)
    margin = np.empty(n)
    nll_a = nll_b = 0.0
    agree = 0
    dp = np.empty(n)
    dlp = np.empty(n)
    flipped = np.zeros(n, dtype=bool)
    for s in range(0, n, ROWS_PER_CHUNK):
        e = min(s + ROWS_PER_CHUNK, n)
        la, lb = a[s:e].astype(np.float64), b[s:e].astype(np.float64)
        tgt = base.targets[s:e]
        ta, tb = la[np.arange(e - s), tgt], lb[np.arange(e - s), tgt]
        nll_a -= ta.sum()
        nll_b -= tb.sum()
        dlp[s:e] = tb - ta
        dp[s:e] = np.exp(tb) - np.exp(ta)
        kl[s:e] = _kl(la, lb)
        top2 = np.partition(la, -2, axis=-1)[:, -2:]
        margin[s:e] = top2[:, 1] - top2[:, 0]
        same = lb.argmax(-1) == la.argmax(-1)
        agree += int(same.sum())
        flipped[s:e] = ~same
    ppl_a, ppl_b = math.exp(nll_a / n), math.exp(nll_b / n)
    finite_kl = kl[np.isfinite(kl)]
    return {
        "positions": n,
        "baseline_perplexity": ppl_a,
        "perplexity": ppl_b,
        "ppl_change_pct": 100.0 * (ppl_b / ppl_a - 1.0),
        "kl_mean": float(kl.mean()),
        "kl_percentiles": percentiles(finite_kl, (0.5, 0.9, 0.95, 0.99, 0.999)),
        "kl_max": float(kl.max()),
        "kl_infinite_positions": int((~np.isfinite(kl)).sum()),
        "top1_agreement": agree / n,
        "top1_flips": n - agree,
        "top1_flip_margin_histogram": histogram(margin_bins(margin[flipped])),
        "baseline_top2_margin_histogram": histogram(margin_bins(margin)),
        "mean_abs_dlogprob_target": float(np.abs(dlp).mean()),
        "delta_p_rms": float(np.sqrt((dp**2).mean())),
        "delta_p_mean": float(dp.mean()),
        "delta_p_percentiles": percentiles(dp, DELTA_P_QUANTILES),
        "delta_p_max": float(dp.max()),
        "delta_p_min": float(dp.min()),
        "nonfinite_positions": int((cand.nonfinite > 0).sum()),
        "_kl": kl,
        "_margin": margin,
        "_flip_margins": margin[flipped],
    }


def judge(metrics: dict, rules: Rules) -> dict:
    reasons = []
    if metrics["nonfinite_positions"]:
        reasons.append(f"{metrics['nonfinite_positions']} positions with NaN/inf logits")
    if not metrics["kl_mean"] <= rules.tf_kl_mean_max:
        reasons.append(f"mean KL {metrics['kl_mean']:.3g} nats > {rules.tf_kl_mean_max:g}")
    if not abs(metrics["ppl_change_pct"]) <= rules.tf_ppl_change_max_pct:
        reasons.append(f"perplexity change {metrics['ppl_change_pct']:+.3f}% beyond +-{rules.tf_ppl_change_max_pct:g}%")
    wide = wide_flip_count(metrics, rules.wide_margin)
    allowed = rules.tf_wide_flip_rate_max * metrics["positions"]
    if wide > allowed:
        reasons.append(f"{wide} top-1 flips where the baseline led by >= {rules.wide_margin:g} nats "
                       f"(allowed {allowed:.1f} of {metrics['positions']} positions)")
    if reasons:
        return result(FAIL, reasons)
    if metrics["positions"] < 1 / max(rules.tf_wide_flip_rate_max, 1e-12):
        return result(INCONCLUSIVE, [f"only {metrics['positions']} positions: too few to bound the wide-flip rate at "
                                     f"{rules.tf_wide_flip_rate_max:g}"])
    return result(PASS, [f"mean KL {metrics['kl_mean']:.3g} nats, perplexity {metrics['ppl_change_pct']:+.3f}%, "
                         f"{wide} confident flips in {metrics['positions']} positions"])


def wide_flip_count(metrics: dict, wide_margin: float) -> int:
    """Flips where the baseline's top-1 led its top-2 by at least `wide_margin` nats."""
    return int((metrics["_flip_margins"] >= wide_margin).sum())
