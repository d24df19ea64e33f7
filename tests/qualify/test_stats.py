"""The task screen's statistics against cases computed by hand."""
import math

import pytest

from qsaserve.qualify.stats import mcnemar_exact, paired_bootstrap, paired_counts, percentiles, tost


def test_mcnemar_exact_is_the_two_sided_binomial_on_discordant_pairs():
    # 1 win, 6 losses: P(X <= 1 | n=7, 1/2) = (1 + 7) / 128, doubled
    assert mcnemar_exact(1, 6) == pytest.approx(16 / 128)
    assert mcnemar_exact(6, 1) == pytest.approx(16 / 128)
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    # 2 vs 10: 2 * (1 + 12 + 66) / 4096
    assert mcnemar_exact(2, 10) == pytest.approx(2 * 79 / 4096)
    assert mcnemar_exact(3, 3) == 1.0 and mcnemar_exact(0, 0) == 1.0


def test_paired_counts():
    c = paired_counts([1, 0, 1, 0, 1], [1, 1, 0, 0, 0])
    assert (c.wins, c.losses, c.ties) == (1, 2, 2)
    with pytest.raises(ValueError):
        paired_counts([1], [1, 0])


def test_paired_bootstrap_hand_computed():
    ci = paired_bootstrap([0, 0, 0], [1, 1, 1])  # every difference is 1
    assert (ci.low, ci.high) == (1.0, 1.0)
    # two items with differences 0 and 1: a resample's mean is 0, 1/2 or 1 with probability 1/4, 1/2, 1/4,
    # so the 90% percentile interval is [0, 1]; the 40% interval sits inside the middle half: [1/2, 1/2]
    ci = paired_bootstrap([0, 0], [0, 1], level=0.9, resamples=20000)
    assert (ci.low, ci.high) == (0.0, 1.0)
    ci = paired_bootstrap([0, 0], [0, 1], level=0.4, resamples=20000)
    assert (ci.low, ci.high) == (0.5, 0.5)
    # seeded: the same interval every time
    a = paired_bootstrap([0, 1, 0, 1, 1], [1, 1, 0, 0, 1], seed=3)
    assert a == paired_bootstrap([0, 1, 0, 1, 1], [1, 1, 0, 0, 1], seed=3)


def test_tost_hand_computed():
    # differences +-0.1, five each: mean 0, sd 0.1 * sqrt(10 / 9), se = sd / sqrt(10) = 0.1 / 3
    base = [0.0] * 10
    cand = [0.1] * 5 + [-0.1] * 5
    eq = tost(base, cand, margin=0.1)
    # t = (0 + 0.1) / (0.1 / 3) = 3 on 9 degrees of freedom: one-sided p = 0.00748 (t tables: t_0.99 = 2.821,
    # t_0.995 = 3.250, so 0.005 < p < 0.01)
    assert eq.p_lower == pytest.approx(0.0074782, abs=1e-6) and eq.p_upper == pytest.approx(eq.p_lower)
    assert eq.equivalent and eq.mean_diff == pytest.approx(0.0, abs=1e-15)
    # margin 0.05: t = 1.5, p = 0.0839 > 0.05 -> not shown
    eq = tost(base, cand, margin=0.05)
    assert eq.p == pytest.approx(0.08389, abs=1e-4) and not eq.equivalent


def test_tost_without_variance():
    assert tost([1, 1, 0], [1, 1, 0], margin=0.05).equivalent  # all ties: difference exactly 0
    eq = tost([0, 0, 0], [1, 1, 1], margin=0.05)  # a constant difference of 1: outside the margin
    assert not eq.equivalent and eq.p == 1.0
    assert not tost([1], [1], margin=0.05).equivalent  # one item proves nothing


def test_percentiles():
    p = percentiles(list(range(101)), (0.5, 0.99))
    assert p == {"p50": 50.0, "p99": 99.0}
    assert math.isnan(paired_bootstrap([], []).low)
