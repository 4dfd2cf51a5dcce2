"""The pure-Python statistics agree with scipy (the reference implementations)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from numaserve.loops.trend import median, median_filter, quantile, theil_sen, theil_sen_slope


@pytest.mark.parametrize("seed", range(40))
def test_theil_sen_and_kendall_match_scipy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(5, 80))
    xs = np.sort(rng.choice(np.arange(10 * n), size=n, replace=False)).astype(float)
    if seed % 4 == 0:  # ties in x and y
        xs = np.sort(rng.integers(0, n // 2 + 2, size=n)).astype(float)
    ys = 3.0 * xs + rng.normal(0, 5 + seed, n)
    if seed % 3 == 0:
        ys = np.round(ys / 10) * 10  # ties in y
    if np.all(xs == xs[0]):
        xs[-1] += 1
    fit = theil_sen(xs.tolist(), ys.tolist())
    ref = stats.theilslopes(ys, xs, 0.95)
    assert fit.slope == pytest.approx(ref.slope, rel=1e-9, abs=1e-9)
    assert fit.intercept == pytest.approx(ref.intercept, rel=1e-9, abs=1e-6)
    assert fit.ci_low == pytest.approx(ref.low_slope, rel=1e-9, abs=1e-9)
    assert fit.ci_high == pytest.approx(ref.high_slope, rel=1e-9, abs=1e-9)
    kt = stats.kendalltau(xs, ys, method="asymptotic")
    assert fit.tau == pytest.approx(kt.statistic, rel=1e-9, abs=1e-12)
    assert fit.p_value == pytest.approx(kt.pvalue, rel=1e-6, abs=1e-300)


def test_slope_only_helper_and_degenerate_inputs() -> None:
    assert theil_sen_slope([0, 1, 2, 3], [0, 2, 4, 6]) == 2
    assert theil_sen_slope([1.0], [5.0]) == 0.0
    with pytest.raises(ValueError):
        theil_sen([1, 2], [1, 2])
    with pytest.raises(ValueError):
        theil_sen([1, 1, 1], [1, 2, 3])
    flat = theil_sen([0, 1, 2, 3, 4], [7, 7, 7, 7, 7])
    assert flat.slope == 0 and flat.p_value == 1.0 and flat.tau == 0


def test_median_quantile_filter() -> None:
    assert median([3, 1, 2]) == 2 and median([4, 1, 2, 3]) == 2.5
    s = sorted([5.0, 1.0, 3.0, 2.0, 4.0])
    for q in (0, 0.1, 0.5, 0.9, 1):
        assert quantile(s, q) == pytest.approx(float(np.quantile(s, q)))
    ys = [1.0] * 10
    ys[4] = 100.0
    ys[5] = 90.0  # a two-point spike vanishes
    assert median_filter(ys, 5) == [1.0] * 10
    step = [0.0] * 5 + [10.0] * 5  # a step survives
    assert median_filter(step, 5) == step
    assert math.isclose(median_filter([1.0, 2.0], 1)[1], 2.0)
