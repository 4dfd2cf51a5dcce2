"""L2 supervisor limits loop: FAIR_SHARE, leases, SLO guard, Vegas mode, overrides, epochs."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numaserve.loops.supervisor_limits import (
    LimitsDecision,
    LimitsLoop,
    VEGAS_REBASE_S,
    LimitsSettings,
    NodeWindow,
    WorkerWindow,
    fair_share,
)


def test_fair_share_doorman_example() -> None:
    assert fair_share(120, [1000, 50, 10]) == [60, 50, 10]
    assert fair_share(120, [10, 20]) == [10, 20]
    assert fair_share(0, [5, 5]) == [0, 0]
    assert fair_share(10, []) == []


@settings(max_examples=300, deadline=None)
@given(st.floats(0, 1e4), st.lists(st.floats(0, 1e4), max_size=12))
def test_fair_share_properties(capacity: float, demands: list[float]) -> None:
    alloc = fair_share(capacity, demands)
    eps = 1e-6 * (1 + capacity + sum(demands))
    assert len(alloc) == len(demands)
    assert sum(alloc) <= capacity + eps
    assert sum(alloc) == pytest.approx(min(capacity, sum(demands)), abs=eps)
    for a, d in zip(alloc, demands):
        assert -eps <= a <= d + eps
    # max-min fair: anyone left short gets at least as much as everybody else
    for i, (a, d) in enumerate(zip(alloc, demands)):
        if a < d - eps:
            assert all(a >= b - eps for b in alloc)


def window(p90_ms: float | None = 50.0, mean_ms: float | None = 40.0, completed: int = 300,
           workers: list[WorkerWindow] | None = None, **kw: object) -> NodeWindow:
    ws = workers if workers is not None else [
        WorkerWindow(slot=0, l1_limit=20, max_inflight=20, queued=5, arrivals=200, admitted=150),
        WorkerWindow(slot=1, l1_limit=20, max_inflight=20, queued=5, arrivals=200, admitted=150),
    ]
    # The guard and Vegas read the server-side delay by default: feed the same values as both signals.
    p90 = None if p90_ms is None else p90_ms / 1e3
    mean = None if mean_ms is None else mean_ms / 1e3
    if "min_total_s" in kw:
        kw.setdefault("min_delay_s", kw["min_total_s"])
    return NodeWindow(duration_s=3.0, completed=completed, admitted=completed, p90_total_s=p90, mean_total_s=mean,
                      p90_delay_s=p90, mean_delay_s=mean, workers=ws, **kw)  # type: ignore[arg-type]


def test_leases_split_by_demand_with_epochs_and_lease_expiry() -> None:
    loop = LimitsLoop(LimitsSettings(), 0.0)
    d = loop.update(3.0, window())
    assert d is not None and d.epoch == 1 and d.changed and d.source == "auto: fair share"
    assert [s.concurrency for s in d.slots] == [20, 20]
    assert all(s.lease_expiry == 13.0 and s.lease_s == 10.0 and s.rate is None for s in d.slots)
    assert loop.update(4.0, window()) is None  # ≥ 3 s between windows
    d2 = loop.update(6.0, window())
    assert d2 is not None and d2.epoch == 1 and not d2.changed and d2.slots[0].lease_expiry == 16.0
    # A slowed worker (L1 fell to 4, demand high) does not cap the healthy one below its own L1.
    slow = [WorkerWindow(slot=0, l1_limit=30, max_inflight=30, queued=30),
            WorkerWindow(slot=1, l1_limit=4, max_inflight=4, queued=40)]
    d3 = loop.update(9.0, window(workers=slow))
    assert d3 is not None and d3.epoch == 2 and [s.concurrency for s in d3.slots] == [30, 4]
    # Idle workers: the budget's leftover is spread, so ceilings stay ≥ their L1 share.
    idle = [WorkerWindow(slot=0, l1_limit=10, max_inflight=1), WorkerWindow(slot=1, l1_limit=10, max_inflight=1)]
    d4 = loop.update(12.0, window(workers=idle))
    assert d4 is not None and [s.concurrency for s in d4.slots] == [10, 10]


def test_slo_guard_backs_off_after_two_windows_then_releases() -> None:
    loop = LimitsLoop(LimitsSettings(), 0.0)
    t = 0.0

    def step(p90: float) -> LimitsDecision:
        nonlocal t
        t += 3.0
        d = loop.update(t, window(p90_ms=p90))
        assert d is not None
        return d

    assert step(250).node_budget == 40  # one window over the SLO: nothing yet
    d = step(250)
    assert d.source.startswith("auto: slo guard") and d.slo_cap == pytest.approx(36.0)
    assert sum(s.concurrency for s in d.slots) == 36  # type: ignore[misc]
    caps = [step(250).slo_cap for _ in range(40)]
    assert caps[0] == pytest.approx(32.4) and caps[-1] == 5.0  # node floor
    assert all(s.concurrency >= 2 for s in loop.last.slots)  # type: ignore[union-attr]
    assert step(180).slo_cap == 5.0  # between 0.8 × SLO and SLO: hold
    step(100)
    d = step(100)  # two windows under 0.8 × SLO: +10 % per window
    assert d.source == "auto: slo release +10%" and d.slo_cap == pytest.approx(5.5)
    while loop.slo_cap is not None:
        d = step(100)
    assert d.source == "auto: slo guard released" and d.node_budget == 40


def _vegas(**kw: object) -> LimitsLoop:
    s = LimitsSettings(mode="vegas", slo_guard=False, vegas_initial_rps=100.0, **kw)  # type: ignore[arg-type]
    return LimitsLoop(s, 0.0)


def test_vegas_scaled_thresholds_and_app_limited_guard() -> None:
    loop = _vegas()
    t = 0.0

    def step(mean_ms: float, admitted: int = 300) -> LimitsDecision:
        nonlocal t
        t += 3.0
        w = window(mean_ms=mean_ms, completed=300)
        w.admitted = admitted
        d = loop.update(t, w)
        assert d is not None
        return d

    assert step(200).node_rate == pytest.approx(110)  # base = 200 ms; diff 0 < max(5, 20) ms
    assert step(250).node_rate == pytest.approx(110)  # 50 ms < max(20, 100) ms: hold (unscaled: −25 %)
    assert step(320).node_rate == pytest.approx(82.5)  # 120 ms > 100 ms
    d = step(205, admitted=90)  # admitted 30/s < 0.5 × rate: no increase
    assert d.node_rate == pytest.approx(82.5) and "app-limited" in d.reason
    assert step(205).node_rate == pytest.approx(90.75)


def test_vegas_window_needs_100_completions_and_rebases() -> None:
    loop = LimitsLoop(LimitsSettings(mode="vegas", slo_guard=False, vegas_initial_rps=20.0), 0.0)
    t = 0.0
    for _ in range(3):  # 3 × 40 completions: one decision at the third window
        t += 3.0
        d = loop.update(t, window(mean_ms=100, completed=40))
    assert d is not None and d.node_rate == pytest.approx(22)
    assert len(loop._means) == 1
    for _ in range(int(VEGAS_REBASE_S / 3) + 2):  # older means are forgotten: the base follows a slower service
        t += 3.0
        loop.update(t, window(mean_ms=150, completed=300))
    assert min(m for _, m in loop._means) == pytest.approx(0.150)


def test_operator_overrides_win_until_auto() -> None:
    loop = LimitsLoop(LimitsSettings(), 0.0)
    loop.update(3.0, window())
    d = loop.override(4.0, slot=1, concurrency=3, rate=7.0)
    assert d.source == "operator" and d.epoch == 2
    assert (d.slots[1].concurrency, d.slots[1].rate, d.slots[1].source) == (3, 7.0, "operator")
    assert d.slots[0].source == "auto: fair share"
    d = loop.update(6.0, window(p90_ms=900))
    assert d is not None and d.slots[1].concurrency == 3 and d.slots[0].concurrency == 20
    d = loop.override(7.0, concurrency=10)  # node total
    assert sum(s.concurrency for s in d.slots if s.slot == 0) == 5 and d.node_budget == 10  # type: ignore[misc]
    d = loop.clear_override(8.0, everything=True)
    assert d.source == "auto" and [s.concurrency for s in d.slots] == [20, 20]
    assert all(s.source == "auto: fair share" for s in d.slots)


def test_static_and_off_modes() -> None:
    d = LimitsLoop(LimitsSettings(mode="static", static_concurrency=6, static_rate=50.0), 0.0).update(3.0, window(p90_ms=999))
    assert d is not None and [s.concurrency for s in d.slots] == [6, 6] and d.slo_cap is None
    assert sum(s.rate for s in d.slots) == pytest.approx(50.0)  # type: ignore[misc]
    d = LimitsLoop(LimitsSettings(mode="off"), 0.0).update(3.0, window())
    assert d is not None and all(s.concurrency is None and s.rate is None for s in d.slots)


def test_node_floor_with_many_workers_keeps_the_total() -> None:
    loop = LimitsLoop(LimitsSettings(), 0.0)
    ws = [WorkerWindow(slot=i, l1_limit=1, max_inflight=1) for i in range(2)]
    d = loop.update(3.0, window(workers=ws))
    assert d is not None and sum(s.concurrency for s in d.slots) == 5  # type: ignore[misc]


def test_settings_section() -> None:
    s = msgspec.convert({"mode": "vegas", "slo_ms": 300}, LimitsSettings)
    assert s.mode == "vegas" and s.slo_ms == 300 and s.interval_s == 3.0
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"mode": "fast"}, LimitsSettings)
    with pytest.raises(ValueError):
        LimitsSettings(lease_s=1.0)
    msgspec.json.encode(LimitsLoop(s, 0.0).update(3.0, window()))


CPU_WORKERS = [WorkerWindow(slot=0, l1_limit=None, max_inflight=120, arrivals=300, admitted=300),
               WorkerWindow(slot=1, l1_limit=None, max_inflight=110, arrivals=300, admitted=300)]


def test_cpu_limited_workers_get_no_ceiling_and_streams_do_not_trip_the_slo_guard() -> None:
    """200 open 20 s streams: total p90 20 s, server-side delay 2 ms. The guard reads the delay."""
    loop = LimitsLoop(LimitsSettings(), 0.0)
    for t in range(1, 8):
        d = loop.update(3.0 * t, NodeWindow(duration_s=3.0, completed=300, admitted=300, p90_total_s=20.0,
                                            mean_total_s=20.0, p90_delay_s=0.002, mean_delay_s=0.001,
                                            workers=CPU_WORKERS))
        assert d is not None and [s.concurrency for s in d.slots] == [None, None] and loop.slo_cap is None
    # the documents' literal rule on total latency would have cut them to the floor
    lit = LimitsLoop(LimitsSettings(slo_signal="total"), 0.0)
    for t in range(1, 40):
        d = lit.update(3.0 * t, NodeWindow(duration_s=3.0, completed=300, admitted=300, p90_total_s=20.0,
                                           p90_delay_s=0.002, workers=CPU_WORKERS))
    assert lit.slo_cap == 5.0 and sum(s.concurrency for s in d.slots) == 5  # type: ignore[misc,union-attr]


def test_a_real_cpu_overload_past_the_slo_caps_cpu_workers_and_an_operator_can_too() -> None:
    loop = LimitsLoop(LimitsSettings(), 0.0)
    for t in range(1, 4):
        d = loop.update(3.0 * t, NodeWindow(duration_s=3.0, completed=300, admitted=300, p90_delay_s=0.4,
                                            workers=CPU_WORKERS))
    assert d is not None and loop.slo_cap is not None and all(s.concurrency for s in d.slots)
    op = LimitsLoop(LimitsSettings(), 0.0)
    op.update(3.0, NodeWindow(duration_s=3.0, workers=CPU_WORKERS))
    d = op.override(4.0, slot=1, concurrency=16)
    assert [s.concurrency for s in d.slots] == [None, 16]


def test_vegas_on_the_delay_signal_is_not_moved_by_long_streams() -> None:
    loop = LimitsLoop(LimitsSettings(mode="vegas", slo_guard=False, vegas_initial_rps=100.0), 0.0)
    rates = []
    for t in range(1, 12):
        d = loop.update(3.0 * t, NodeWindow(duration_s=3.0, completed=300, admitted=300, mean_total_s=20.0,
                                            min_total_s=0.001, mean_delay_s=0.002, min_delay_s=0.0005,
                                            workers=CPU_WORKERS))
        rates.append(d.node_rate)  # type: ignore[union-attr]
    assert rates[-1] > 100.0  # delay − min < 5 ms: +10 % per decision, never −25 %


def test_each_slot_gets_its_own_reason_not_another_slots_override() -> None:
    loop = LimitsLoop(LimitsSettings(), 0.0)
    loop.update(3.0, window())
    d = loop.override(4.0, slot=1, concurrency=3)
    assert (d.slots[0].reason, d.slots[1].reason) == ("auto: fair share", "operator override for slot 1")
    d = loop.override(5.0, slot=0, concurrency=4)
    assert (d.slots[0].reason, d.slots[1].reason) == ("operator override for slot 0", "operator override for slot 1")
    d = loop.update(6.0, window())   # a tick keeps each override's own reason
    assert d is not None and d.slots[1].reason == "operator override for slot 1"
    d = loop.clear_override(7.0, slot=1)
    assert (d.slots[0].reason, d.slots[1].reason) == ("operator override for slot 0", "auto: fair share")
    d = loop.override(8.0, concurrency=10)
    assert d.slots[1].reason == "operator override for node" and d.slots[0].reason == "operator override for slot 0"
