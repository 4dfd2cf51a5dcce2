"""L1 gradient controller driven by synthetic samples on a virtual clock (Envoy-style tests)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numaserve.loops.gradient import GradientController, GradientSettings


def feed(c: GradientController, now: float, n: int, service: float, inflight: int, outcome: str = "ok") -> None:
    for _ in range(n):
        c.on_sample(now, service, inflight, outcome, started_at=now - service)  # type: ignore[arg-type]


def with_baseline(base: float = 0.020, **kw: float) -> tuple[GradientController, float]:
    """A controller that finished its first probe at t=1 with baseline ``base``."""
    c = GradientController(GradientSettings(**kw), 0.0, rng=random.Random(1))
    assert c.probing and c.limit == max(2, math.ceil(c.nominal_limit / 4))  # max(floor, ceil(L/4))
    feed(c, 1.0, 50, base, 4)
    c.update(1.0)
    assert not c.probing and c.baseline_s == pytest.approx(base)
    return c, 1.0


def test_initial_probe_pins_then_restores_and_filters_old_requests() -> None:
    c = GradientController(GradientSettings(), 10.0, rng=random.Random(1))
    assert c.probing and c.limit == 4 and c.nominal_limit == 16
    # Requests that started before the probe (slow, queued behind the old limit) are ignored.
    for _ in range(200):
        c.on_sample(10.5, 0.5, 16, "ok", started_at=10.0 - 0.01)
    c.update(10.5)
    assert c.probing and c.baseline_s is None
    feed(c, 11.0, 49, 0.020, 4)
    c.update(11.0)
    assert c.probing  # 49 < 50
    feed(c, 11.1, 1, 0.020, 4)
    assert c.update(11.1) == 16
    assert c.baseline_s == pytest.approx(0.020) and c.probes == 1


def test_increase_uses_gradient_plus_sqrt_headroom() -> None:
    c, t = with_baseline()
    feed(c, t + 0.6, 40, 0.020, 16)  # at the baseline: g = 1.25
    new = c.update(t + 0.6)
    assert new == pytest.approx(16 * 1.25 + math.sqrt(16 * 1.25))
    assert c.last_reason == "increase" and c.last_gradient == pytest.approx(1.25)


def test_no_window_before_half_a_second_and_thirty_samples() -> None:
    c, t = with_baseline()
    feed(c, t + 0.6, 29, 0.020, 16)
    assert c.update(t + 0.6) == 16 and c.windows == 0
    feed(c, t + 0.7, 1, 0.020, 16)
    assert c.update(t + 0.7) > 16 and c.windows == 1


def test_long_window_with_few_samples_holds() -> None:
    c, t = with_baseline()
    feed(c, t + 1, 5, 0.020, 16)
    assert c.update(t + 5.1) == 16 and c.last_reason == "hold (few samples)"
    feed(c, t + 6, 12, 0.020, 16)
    assert c.update(t + 10.2) > 16  # 12 ≥ window_floor_samples at the 5 s mark


def test_app_limited_guard() -> None:
    c, t = with_baseline()
    feed(c, t + 0.6, 40, 0.020, 7)  # max in-flight 7 < 16/2
    assert c.update(t + 0.6) == 16 and c.last_reason == "app-limited"


def test_growth_cap_is_five_times_window_max_inflight() -> None:
    c, t = with_baseline(initial_limit=2.0)
    assert c.limit == 2
    feed(c, t + 0.6, 40, 0.005, 1)  # g = 2: 2·2 + 2 = 6, but 5 × 1 = 5
    assert c.update(t + 0.6) == pytest.approx(5.0)


def test_decrease_is_smoothed_unless_codel_overloaded() -> None:
    c, t = with_baseline()
    feed(c, t + 0.6, 40, 0.050, 16)  # g = 0.025/0.05 = 0.5: target 8, no headroom below g = 1
    assert c.update(t + 0.6) == pytest.approx(16 + 0.5 * (8 - 16))
    feed(c, t + 1.2, 40, 0.050, 16)
    assert c.update(t + 1.2, overloaded=True) == pytest.approx(12 * 0.5)


def test_drop_backs_off_once_per_window() -> None:
    c, t = with_baseline()
    feed(c, t + 0.6, 40, 0.020, 16)
    feed(c, t + 0.6, 5, 0.9, 16, outcome="dropped")
    assert c.update(t + 0.6) == pytest.approx(16 * 0.9) and c.last_reason == "drop"
    feed(c, t + 1.2, 40, 0.020, 16, outcome="ignored")  # 500s: no sample at all
    assert c.update(t + 1.2) == pytest.approx(14.4) and c.windows == 1


def test_floor_ceiling_and_forced_reprobe_after_five_floor_windows() -> None:
    c, t = with_baseline()
    now = t
    # Capacity dropped: service is 5× the baseline for good; the limit falls to the floor ...
    while not c.probing:
        now += 0.6
        feed(c, now, 40, 0.100, max(2, int(c.limit)))
        c.update(now, overloaded=True)
        assert 2 <= c.limit <= 256
    assert c.nominal_limit == 2 and c.last_reason == "probe (forced)"
    # ... and a forced probe replaces the stale baseline (kept minimum would pin it again).
    feed(c, now + 1, 50, 0.100, 2)
    c.update(now + 1)
    assert c.baseline_s == pytest.approx(0.100)
    for _ in range(30):
        now += 1.0
        feed(c, now + 1, 40, 0.100, max(2, int(c.limit)))
        c.update(now + 1)
    assert c.limit == 256 or c.limit > 20  # recovers against the new baseline


def test_periodic_probe_with_jitter_keeps_min_of_last_three() -> None:
    c, t = with_baseline(0.030)
    nxt = c.state().next_probe_at
    assert nxt is not None and t + 60 <= nxt <= t + 60 * 1.15
    c.update(nxt - 0.01)
    assert not c.probing
    c.update(nxt)
    assert c.probing and c.limit == max(2, math.ceil(c.nominal_limit / 4))
    feed(c, nxt + 1, 50, 0.040, 4)
    c.update(nxt + 1)
    assert c.baseline_s == pytest.approx(0.030)  # min of the kept baselines


def test_settings_validation() -> None:
    with pytest.raises(ValueError):
        GradientSettings(min_limit=10, initial_limit=5)
    with pytest.raises(ValueError):
        GradientSettings(percentile=1.5)
    assert not GradientSettings().probe_percentile  # like-for-like with ``percentile``


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0005, 2.0), st.integers(0, 400), st.sampled_from(["ok", "ok", "dropped", "ignored"]),
                          st.floats(0.0, 0.8)), min_size=1, max_size=300),
       st.floats(1, 8), st.floats(16, 64))
def test_limit_always_within_floor_and_ceiling(events: list, floor: float, ceiling: float) -> None:
    s = GradientSettings(min_limit=floor, max_limit=ceiling, initial_limit=floor)
    c = GradientController(s, 0.0, rng=random.Random(0))
    now = 0.0
    for service, inflight, outcome, dt in events:
        now += dt
        c.on_sample(now, service, inflight, outcome)  # type: ignore[arg-type]
        lim = c.update(now, overloaded=dt > 0.5)
        assert floor <= lim <= ceiling and floor <= c.nominal_limit <= ceiling
