"""Paired statistics of the task screen: each item is scored by both configurations with the same
prompt and seed, so the comparison is per item (wins, losses, ties), never two unpaired means.

  mcnemar_exact    McNemar's exact test on the discordant pairs (binary scores): under "no
                   difference" a discordant pair is a win or a loss with probability 1/2, so the
                   two-sided p-value is scipy's exact binomial test of wins among wins + losses.
  paired_bootstrap a percentile interval of the mean score difference (candidate - baseline),
                   resampling items with replacement (numpy, seeded).
  tost             two one-sided t-tests on the per-item differences against an equivalence
                   margin: equivalent when both one-sided p-values are below alpha, which is the
                   same as the (1 - 2 alpha) t interval lying inside (-margin, +margin).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


def _scipy_stats():
    try:
        from scipy import stats
    except ImportError as e:  # pragma: no cover - scipy is in the qualify and test extras
        raise ImportError("qsaserve qualify's task statistics need scipy: pip install 'qsaserve[qualify]'") from e
    return stats


@dataclass
class PairedCounts:
    wins: int  # candidate scored higher than the baseline on the item
    losses: int  # candidate scored lower
    ties: int


def paired_counts(baseline: list[float], candidate: list[float]) -> PairedCounts:
    if len(baseline) != len(candidate):
        raise ValueError(f"paired scores need equal lengths, got {len(baseline)} and {len(candidate)}")
    wins = sum(c > b for b, c in zip(baseline, candidate))
    losses = sum(c < b for b, c in zip(baseline, candidate))
    return PairedCounts(wins, losses, len(baseline) - wins - losses)


def mcnemar_exact(wins: int, losses: int) -> float:
    """Two-sided exact p-value; 1.0 without discordant pairs (no evidence of a difference)."""
    n = wins + losses
    if n == 0:
        return 1.0
    return float(_scipy_stats().binomtest(wins, n, 0.5, alternative="two-sided").pvalue)


@dataclass
class Interval:
    low: float
    high: float
    level: float  # e.g. 0.90


def paired_bootstrap(baseline: list[float], candidate: list[float], *, level: float = 0.90, resamples: int = 10000,
                     seed: int = 0) -> Interval:
    """Percentile interval of mean(candidate - baseline) over items resampled with replacement."""
    diffs = np.asarray(candidate, dtype=np.float64) - np.asarray(baseline, dtype=np.float64)
    if diffs.size == 0:
        return Interval(math.nan, math.nan, level)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, diffs.size, size=(resamples, diffs.size))
    means = diffs[idx].mean(axis=1)
    tail = (1.0 - level) / 2
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return Interval(float(low), float(high), level)


@dataclass
class Equivalence:
    mean_diff: float
    margin: float
    alpha: float
    p_lower: float  # H0: mean diff <= -margin
    p_upper: float  # H0: mean diff >= +margin
    p: float  # max of the two: equivalence is shown when p < alpha
    equivalent: bool
    n: int

    def as_dict(self) -> dict:
        return asdict(self)


def tost(baseline: list[float], candidate: list[float], margin: float, alpha: float = 0.05) -> Equivalence:
    """Paired TOST on per-item differences. With zero variance the t statistics are infinite: the
    differences are all one value d, equivalent exactly when |d| < margin."""
    diffs = np.asarray(candidate, dtype=np.float64) - np.asarray(baseline, dtype=np.float64)
    n = int(diffs.size)
    if n < 2:
        return Equivalence(float(diffs.mean()) if n else math.nan, margin, alpha, 1.0, 1.0, 1.0, False, n)
    mean = float(diffs.mean())
    if float(diffs.std()) == 0.0:
        p_lower = 0.0 if mean > -margin else 1.0
        p_upper = 0.0 if mean < margin else 1.0
    else:
        stats = _scipy_stats()
        p_lower = float(stats.ttest_1samp(diffs, -margin, alternative="greater").pvalue)
        p_upper = float(stats.ttest_1samp(diffs, margin, alternative="less").pvalue)
    p = max(p_lower, p_upper)
    return Equivalence(mean, margin, alpha, p_lower, p_upper, p, p < alpha, n)


def percentiles(values, qs=(0.5, 0.9, 0.95, 0.99, 0.999)) -> dict[str, float]:
    """{"p50": ..., "p99.9": ...} of a 1-D array (float64)."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        return {}
    out = np.quantile(arr, qs)
    return {f"p{100 * q:g}": float(v) for q, v in zip(qs, out)}
