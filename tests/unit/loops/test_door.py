"""The supervisor's 503 decision for a worker's accept queue (numaserve.loops.door), on data."""

from __future__ import annotations

import math

from numaserve.loops import door
from numaserve.loops.admission import AdmissionSettings
from numaserve.net.gatepage import GateView

S = AdmissionSettings()


def view(**kw: object) -> GateView:
    base = dict(pid=10, tid=11, beat=100.0, period=0.001, thread_cpu=5.0, inflight=3, waiting=0,
                request_cpu_s=0.02, stall_limit=0.002, last_shed=99.9, overloaded=True)
    base.update(kw)
    return GateView(**base)  # type: ignore[arg-type]


def test_idle_or_unlearnt_or_calm_workers_are_never_answered_for() -> None:
    assert door.excess(None, 100.0, 5.0, 50, S) == 0
    assert door.excess(view(inflight=0), 100.0, 5.0, 50, S) == 0
    assert door.excess(view(request_cpu_s=0.0), 100.0, 5.0, 50, S) == 0
    # a burst: not overloaded and nothing shed lately -> the loop's own gate decides
    calm = view(overloaded=False, last_shed=-math.inf)
    assert not door.armed(calm, 100.0, S)
    assert door.excess(calm, 100.0, 5.0, 50, S) == 0
    assert door.excess(view(), 100.0, 5.0, 0, S) == 0


def test_overloaded_keeps_what_the_gate_would_admit_and_answers_the_rest() -> None:
    bound = max(S.cpu_concurrency, math.ceil(S.overload_wait_s / 0.02))
    now = 100.0005   # fresh stamp
    assert door.excess(view(), now, 5.0, bound + 7, S) == 7
    assert door.excess(view(), now, 5.0, bound, S) == 0
    # requests already waiting for CPU use up the room
    assert door.excess(view(waiting=bound), now, 5.0, 5, S) == 5
    # a stale stamp (late, but not a confirmed stall) -> leave it to the worker
    assert door.excess(view(), 100.0 + 0.001 + door.STAMP_FRESH_S + 0.001, 5.0, 100, S) == 0
    # overloaded but it has not shed within overload_hold_s: not armed
    assert door.excess(view(last_shed=100.0 - S.overload_hold_s - 1), now, 5.0, 100, S) == 0


def test_a_stall_counts_only_when_the_loop_thread_ran() -> None:
    now = 100.5          # 0.5 s since the stamp: far past stall_limit
    ran = 5.0 + 0.45     # the loop's thread was on a CPU 90 % of that time: a handler holds it
    n = door.excess(view(), now, ran, 30, S)
    keep = max(S.stall_queue, math.ceil(max(0.0, S.overload_wait_s - (now - 100.0 - 0.001)) / 0.02))
    assert n == 30 - keep and n > 0
    # descheduled (waited for a CPU, ran 10 %): not stalled, nothing answered
    assert door.excess(view(), now, 5.0 + 0.05, 30, S) == 0
    # CPU time unknown: a stall is not confirmed
    assert door.excess(view(), now, None, 30, S) == 0
    # never below stall_queue
    assert door.excess(view(), now, ran, S.stall_queue, S) == 0


def test_stalled_for_is_how_late_the_probe_is() -> None:
    assert door.stalled_for(view(beat=10.0, period=0.5), 11.0) == 0.5
