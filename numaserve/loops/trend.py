"""Robust trend statistics in pure Python (no numpy: workers and the supervisor stay light).

Theil–Sen slope with Sen's confidence interval and the Kendall tau test, both
from one pass over the point pairs, matching ``scipy.stats.theilslopes`` and
``kendalltau(method="asymptotic")``.  O(n²) is fine for the ≤ ~100
downsampled points the leak detector feeds in (≈ 5,000 pairs, a few ms).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from itertools import repeat
from operator import sub, truediv
from statistics import NormalDist
from typing import NamedTuple, Sequence

__all__ = ["TrendFit", "median", "median_filter", "quantile", "theil_sen", "theil_sen_slope"]


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence (mean of the two middle values when even)."""
    s = sorted(values)
    n = len(s)
    if n == 0:
        raise ValueError("median of an empty sequence")
    mid = n // 2
    return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """q-quantile (0..1) of already sorted values, linear interpolation (numpy's default)."""
    n = len(sorted_values)
    if n == 0:
        raise ValueError("quantile of an empty sequence")
    pos = min(max(q, 0.0), 1.0) * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def median_filter(values: Sequence[float], width: int = 5) -> list[float]:
    """Running median (window shrinks at the edges): removes 1–2 point spikes, keeps steps."""
    if width <= 1:
        return list(values)
    half = width // 2
    n = len(values)
    return [median(values[max(0, i - half) : min(n, i + half + 1)]) for i in range(n)]


class TrendFit(NamedTuple):
    """Theil–Sen fit plus Kendall test of y against x."""

    n: int
    slope: float
    intercept: float
    ci_low: float
    ci_high: float
    tau: float
    p_value: float  # two-sided, asymptotic with tie corrections


def _tie_sums(values: Sequence[float]) -> tuple[float, float, float]:
    """(Σ t(t-1)/2, Σ t(t-1)(t-2), Σ t(t-1)(2t+5)) over groups of tied values."""
    a = b = c = 0.0
    for t in Counter(values).values():
        if t > 1:
            a += t * (t - 1) / 2
            b += t * (t - 1) * (t - 2)
            c += t * (t - 1) * (2 * t + 5)
    return a, b, c


def _pairwise_slopes(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], int, int]:
    """Sorted slopes over pairs with distinct x, and (concordant, discordant) pair counts."""
    n = len(xs)
    increasing = all(xs[i] < xs[i + 1] for i in range(n - 1))
    slopes: list[float] = []
    if increasing:
        # x strictly increasing: sign(dy) == sign(slope), so Kendall comes from the slopes.
        for i in range(n - 1):
            tail = i + 1
            slopes.extend(map(truediv, map(sub, ys[tail:], repeat(ys[i])), map(sub, xs[tail:], repeat(xs[i]))))
        slopes.sort()
        neg = bisect.bisect_left(slopes, 0.0)
        pos = len(slopes) - bisect.bisect_right(slopes, 0.0)
        return slopes, pos, neg
    con = dis = 0
    for i in range(n - 1):
        for j in range(i + 1, n):
            dx = xs[j] - xs[i]
            dy = ys[j] - ys[i]
            if dx != 0:
                slopes.append(dy / dx)
            p = dx * dy
            if p > 0:
                con += 1
            elif p < 0:
                dis += 1
    slopes.sort()
    return slopes, con, dis


def theil_sen_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Median pairwise slope only (cheap sub-window fits); 0.0 with fewer than 2 points."""
    if len(xs) < 2:
        return 0.0
    slopes, _, _ = _pairwise_slopes(xs, ys)
    return median(slopes) if slopes else 0.0


def theil_sen(xs: Sequence[float], ys: Sequence[float], confidence: float = 0.95) -> TrendFit:
    """Theil–Sen slope with Sen (1968) CI and Kendall tau-b test, from one pair pass.

    Robust to outliers (29 % breakdown) where OLS is not; the CI and p-value
    assume independent residuals, so callers add structural checks on top.
    """
    n = len(xs)
    if n != len(ys):
        raise ValueError("xs and ys differ in length")
    if n < 3:
        raise ValueError("need at least 3 points")
    slopes, con, dis = _pairwise_slopes(xs, ys)
    if not slopes:
        raise ValueError("all x values are equal")
    slope = median(slopes)
    intercept = median(ys) - slope * median(xs)

    x_tie, x_t2, x_t5 = _tie_sums(xs)
    y_tie, y_t2, y_t5 = _tie_sums(ys)

    # Sen's CI: ranks of the sorted slopes around the median.
    z = NormalDist().inv_cdf(0.5 - confidence / 2)  # negative
    nt = len(slopes)
    sigsq = (n * (n - 1) * (2 * n + 5) - x_t5 - y_t5) / 18.0
    sigma = math.sqrt(max(sigsq, 0.0))
    ru = min(int(round((nt - z * sigma) / 2.0)), nt - 1)
    rl = max(int(round((nt + z * sigma) / 2.0)) - 1, 0)
    ci_low, ci_high = slopes[rl], slopes[ru]

    # Kendall tau-b, asymptotic variance with ties (as scipy).
    s = con - dis
    n0 = n * (n - 1) / 2
    denom = math.sqrt(max((n0 - x_tie) * (n0 - y_tie), 0.0))
    tau = s / denom if denom > 0 else 0.0
    m = n * (n - 1.0)
    var = (m * (2 * n + 5) - x_t5 - y_t5) / 18 + (2 * x_tie * y_tie) / m + x_t2 * y_t2 / (9 * m * (n - 2))
    if var > 0:
        zs = s / math.sqrt(var)
        p = math.erfc(abs(zs) / math.sqrt(2))
    else:
        p = 1.0
    return TrendFit(n, slope, intercept, ci_low, ci_high, tau, min(p, 1.0))
