"""The "cpu" limiter (``CpuGate``) on a virtual clock, and its settings' range checks."""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from numaserve.loops.admission import AdmissionSettings, Admit, Reject
from numaserve.loops.checks import SettingError
from numaserve.loops.cpu_gate import REFUSING_ITERATIONS, CpuGate
from numaserve.loops.supervisor_limits import LimitsSettings


def gate(request_cpu_s: float = 0.020, **kw: object) -> CpuGate:
    """A gate that has learnt its requests cost ``request_cpu_s`` of CPU each (20 ms jobs)."""
    g = CpuGate(AdmissionSettings(**kw), 0.0, rng=random.Random(3))  # type: ignore[arg-type]
    g.request_cpu_s = request_cpu_s
    return g


def busy_for(g: CpuGate, start: float, seconds: float, lag: float = 0.015, load: float = 2.0) -> float:
    """Probe samples of a loop that never idles: one per iteration, each ``lag`` late, while work
    arrives ``load`` times as fast as the CPU does it (the requests read by the loop and decided on
    by the gate elsewhere in the iteration, counted here without their permits)."""
    t, owed = start, 0.0
    while t < start + seconds:
        dt = g.probe_delay() + lag
        t += dt
        owed += load * dt / g.request_cpu_s
        g._arrivals += int(owed)       # noqa: SLF001 (the count try_admit keeps, without a permit)
        owed -= int(owed)
        g.on_lag(t, lag)
    return t


def test_an_idle_or_late_loop_without_queued_work_admits_everything() -> None:
    g = gate()
    # 1000 requests awaiting I/O (nothing runnable): the loop lag is what it is, nobody waits for CPU.
    t = busy_for(g, 0.0, 2.0)
    assert g.short_of_cpu(t) and g.overloaded(t)
    out = [g.try_admit(t, runnable=(0, 0)) for _ in range(1000)]
    assert all(isinstance(d, Admit) for d in out) and g.inflight == 1000
    # One request ahead (a blocking call just ran, or one cooperative job): still admitted.
    assert isinstance(g.try_admit(t, runnable=(1, 0)), Admit)


def test_short_of_cpu_with_queued_work_sheds_503_with_retry_after() -> None:
    g = gate()
    t = busy_for(g, 0.0, 2.0)
    d = g.try_admit(t, runnable=(2, 0))
    assert isinstance(d, Reject) and d.status == 503 and d.reason == "cpu" and d.retry_after in (1, 2)
    assert g.shedding(t) and not g.shedding(t + 1.5)
    snap = g.snapshot(t)
    assert snap.shed == {"cpu": 1} and snap.status_503 == 1 and snap.short_of_cpu and snap.limit is None


def test_a_burst_is_not_overload_until_the_loop_stays_busy() -> None:
    g = gate(request_cpu_s=0.005, cpu_burst=8)
    g.on_lag(0.5, 0.030)          # one long iteration on a quiet worker
    assert g.short_of_cpu(0.5) and not g.overloaded(0.5)
    assert isinstance(g.try_admit(0.5, runnable=(5, 0)), Admit)   # a burst: up to cpu_burst, 0.1 s of CPU
    assert isinstance(g.try_admit(0.5, runnable=(8, 0)), Reject)
    t = busy_for(g, 0.5, 2.0)     # no idle moment for 2 s: overloaded, the tight bound applies
    assert g.overloaded(t) and isinstance(g.try_admit(t, runnable=(8, 0)), Reject)
    g.request_cpu_s = 0.020
    assert isinstance(g.try_admit(t, runnable=(2, 0)), Reject)
    # idle samples release it (hysteresis: only once the busy share fell below busy_release)
    for i in range(400):
        t += 0.008
        g.on_lag(t, 0.0)
    assert not g.overloaded(t) and not g.short_of_cpu(t)


def test_a_loop_busy_near_capacity_is_not_overloaded_until_work_outpaces_it() -> None:
    """Near capacity (0.9x: each worker at ~0.8 of its CPU) a second or two without an idle moment
    is chance, not overload: the burst bound stays, not the tight one (issue 32's sweep: 0.9x shed
    0-22 % -> 0 %).  Work arriving faster than the CPU does it makes the same busy loop overloaded."""
    g = gate(request_cpu_s=0.020)
    t = busy_for(g, 0.0, 3.0, load=0.8)
    assert g.short_of_cpu(t) and not g.overloaded(t)
    assert isinstance(g.try_admit(t, runnable=(3, 0)), Admit)      # 60 ms of CPU waits: a burst, admitted
    t = busy_for(g, t, 2.0, load=2.0)
    assert g.overloaded(t) and isinstance(g.try_admit(t, runnable=(3, 0)), Reject)
    # once overloaded, arrivals falling off do not end it alone: the loop's idle moments do
    t = busy_for(g, t, 0.5, load=0.5)
    assert g.overloaded(t)


def test_a_burst_that_outgrows_its_bound_at_twice_the_capacity_is_an_overload_at_once() -> None:
    """The start of an overload: work arrives faster than the CPU does it, so the first refusal of
    the burst bound says "overloaded" (tight bound, sentinel at 2 ms) instead of ~1.5 s later."""
    g = gate(request_cpu_s=0.020)
    t = 1.0
    for i in range(7):        # 7 x 20 ms of work arrive in 70 ms: 2x what the CPU does
        t += 0.010
        g.on_lag(t, 0.015)    # busy samples (short of CPU), no idle moment
        d = g.try_admit(t, runnable=(0, i))
    assert isinstance(d, Reject) and g.overloaded(t)
    assert g.stall_limit(t) == g.s.stall_after_s


def test_a_burst_near_capacity_that_outgrows_its_bound_stays_a_burst() -> None:
    """The same refusal after a long busy spell at ~1x (the queue reached the bound by chance):
    not an overload; and an idle moment starts a new spell."""
    g = gate(request_cpu_s=0.020)
    t = 1.0
    for _ in range(100):      # 1 s busy, 50 requests of 20 ms: the CPU keeps up
        t += 0.020
        g.on_lag(t, 0.015)
        g.try_admit(t, runnable=(0, 0))
    d = g.try_admit(t, runnable=(0, 5))
    assert isinstance(d, Reject) and not g.overloaded(t)
    g.on_lag(t + 0.001, 0.0)  # an on-time probe: the loop idled
    assert g._spell_at == t + 0.001


def test_the_cost_before_any_request_finished_is_a_lower_bound_not_the_prior() -> None:
    g = CpuGate(AdmissionSettings(), 0.0)
    for _ in range(4):
        g.try_admit(0.0)
    g.on_cpu(0.0, 0.0, 0.0)
    g.on_cpu(0.1, 0.08, 0.08)  # 80 ms of loop CPU, 4 in flight, none done: >= 20 ms each
    assert g.request_cpu_s == pytest.approx(0.02)
    g.release(0.15, g.try_admit(0.15).permit, "ok")  # type: ignore[union-attr]
    g.on_cpu(0.2, 0.09, 0.09)  # then learnt from completions as before
    assert g.request_cpu_s == pytest.approx(0.01)


def test_the_sentinel_acts_on_a_short_stall_while_the_gate_sheds() -> None:
    g = gate(stall_after_s=0.002, stall_idle_after_s=1.0, overload_hold_s=1.0)
    assert g.stall_limit(0.0) == 1.0
    g.on_lag(0.5, 0.030)
    assert isinstance(g.try_admit(0.5, runnable=(8, 0)), Reject) and not g.overloaded(0.5)
    assert g.stall_limit(0.6) == 0.002 and g.stall_limit(1.6) == 1.0


def test_an_armed_probe_that_did_not_fire_counts_as_lag() -> None:
    """The loop stuck in a 50 ms call has not run its probe: the gate sees that lateness at once."""
    g = gate()
    assert isinstance(g.try_admit(0.0), Admit)       # in flight: the shell arms the probe
    assert not g.short_of_cpu(0.0005)
    assert g.short_of_cpu(0.05)


def test_runnable_is_counted_only_when_short_of_cpu() -> None:
    g = gate()
    calls = []

    def count() -> tuple[int, int]:
        calls.append(1)
        return 0, 0

    g.try_admit(0.0, runnable=count)
    assert calls == []
    t = busy_for(g, 0.0, 1.0)
    g.try_admit(t, runnable=count)
    assert calls == [1]


def test_new_requests_count_as_queue_when_overloaded_and_by_their_cost_in_a_burst() -> None:
    g = gate(request_cpu_s=0.002, burst_wait_s=0.2)
    g.on_lag(0.5, 0.030)                                   # short of CPU, not overloaded
    assert isinstance(g.try_admit(0.5, runnable=(0, 40)), Admit)   # 40 new x 2 ms (prior) < 200 ms
    g.request_cpu_s = 0.020                                # learnt: requests cost 20 ms
    assert isinstance(g.try_admit(0.5, runnable=(0, 10)), Reject)  # 10 x 20 ms: 200 ms of queue
    t = busy_for(g, 0.5, 2.0)
    assert g.overloaded(t) and isinstance(g.try_admit(t, runnable=(0, 2)), Reject)


def test_overloaded_a_queue_of_cheap_requests_is_not_refused() -> None:
    """8 closed-loop clients of a 5 ms endpoint: 7 wait, 35 ms of CPU < overload_wait_s."""
    g = gate(request_cpu_s=0.005)
    t = busy_for(g, 0.0, 2.0)
    assert g.overloaded(t)
    assert isinstance(g.try_admit(t, runnable=(3, 4)), Admit)
    assert isinstance(g.try_admit(t, runnable=(4, 4)), Reject)


def test_thread_pool_cpu_counts_as_one_waiting_request() -> None:
    g = gate()
    t = busy_for(g, 0.0, 2.0)
    g.on_cpu(t, 10.0, 10.0)
    g.on_cpu(t + 0.1, 10.01, 10.1)          # other threads: 0.09 s of CPU in 0.1 s
    assert g.other_threads_cpu == pytest.approx(0.9)
    t = busy_for(g, t + 0.1, 0.2)
    assert isinstance(g.try_admit(t, runnable=(1, 0)), Reject)


def test_inflight_cap_lease_quota_and_deadline() -> None:
    g = gate(max_inflight=2)
    assert all(isinstance(g.try_admit(0.0), Admit) for _ in range(2))
    r = g.try_admit(0.0)
    assert isinstance(r, Reject) and r.reason == "limit"
    g = gate()
    assert g.set_limits(0.0, 3, concurrency=1, lease_expiry=10.0, safe_concurrency=5)
    assert not g.set_limits(0.0, 2, concurrency=99)          # stale epoch
    p = g.try_admit(1.0)
    assert isinstance(p, Admit) and isinstance(g.try_admit(1.0), Reject)
    assert g.limit(11.0) == 5                                # lease expired: the safe ceiling
    g.release(1.0, p.permit)
    g.set_limits(2.0, 4, rate=10.0, burst=1.0)
    assert isinstance(g.try_admit(2.0), Admit)
    q = g.try_admit(2.0)
    assert isinstance(q, Reject) and q.status == 429 and q.retry_after == 1
    d = g.try_admit(5.0, deadline=4.0)
    assert isinstance(d, Reject) and d.status == 504 and d.retry_after is None
    assert g.set_limits(5.0, 5, concurrency=0) and g.try_admit(5.0).reason == "limit"  # type: ignore[union-attr]


def test_release_and_gone_clients_free_their_permit_once() -> None:
    g = gate()
    a = g.try_admit(0.0)
    b = g.try_admit(0.0)
    assert isinstance(a, Admit) and isinstance(b, Admit) and g.inflight == 2
    g.release(0.1, a.permit, "ok")
    g.release(0.1, a.permit, "ok")
    g.client_gone(0.2, b.permit)
    g.client_gone(0.2, b.permit)
    snap = g.snapshot(0.3)
    assert g.inflight == 0 and snap.ok == 1 and snap.completed == 1 and snap.client_gone == 2


def test_stall_excess_leaves_a_small_queue_and_waits_for_a_real_stall() -> None:
    g = gate(stall_queue=1, stall_after_s=0.002, stall_idle_after_s=0.05)  # (default idle: 1 s)
    assert g.stall_excess(0.0, 1.0, 10) == 0          # nothing in flight: the loop is idle, not stalled
    g.try_admit(0.0)
    assert g.stall_excess(0.01, 0.01, 4) == 0         # quiet worker: one 10 ms call is no stall ...
    assert g.stall_excess(0.06, 0.06, 4) == 3         # ... 60 ms is: leave one for the loop
    # ... unless the queue holds more CPU than a burst may wait for (10 x 20 ms >= burst_wait_s):
    # an overload starting before the loop refused anything; what the burst bound admits stays
    assert g.stall_excess(0.01, 0.001, 10) == 0 and g.stall_excess(0.01, 0.01, 10) == 10 - 5
    assert g.stall_excess(0.06, 0.06, 10) == 9        # 60 ms: the idle limit's rule, one stays
    t = busy_for(g, 0.1, 2.0)
    assert g.overloaded(t)
    g.request_cpu_s = 0.05                            # long calls: only stall_queue stays
    assert g.stall_excess(t, 0.003, 4) == 3 and g.stall_excess(t, 0.001, 4) == 0
    g.record_stall_shed(t, 3)
    assert g.snapshot(t).shed["stalled"] == 3


def test_stall_excess_keeps_what_the_loop_would_admit() -> None:
    """Behind a short blocking handler the queue fits overload_wait_s: a closed loop of 8 clients
    of a 5 ms endpoint is served, not shed; behind a 20 ms one 2 stay; a long stall keeps stall_queue."""
    g = gate(stall_queue=1, stall_after_s=0.002, overload_wait_s=0.04)
    g.try_admit(0.0)
    t = busy_for(g, 0.1, 2.0)
    assert g.overloaded(t)
    g.request_cpu_s = 0.005
    assert g.stall_excess(t, 0.003, 7) == 0           # 7 x 5 ms fits in the 37 ms left
    assert g.stall_excess(t, 0.003, 12) == 12 - 8     # ceil(37 / 5) = 8 stay
    g.request_cpu_s = 0.02
    assert g.stall_excess(t, 0.003, 6) == 6 - 2       # ceil(37 / 20) = 2 stay
    assert g.stall_excess(t, 0.05, 6) == 6 - 1        # past overload_wait_s: stall_queue only


def test_stall_excess_counts_the_work_queued_behind_the_call() -> None:
    """Issue 32: what stays in the accept queue is what the gate admits once the loop is back,
    after the call running now and the requests already waiting behind it; the rest is answered
    by the sentinel at once instead of by the loop a call and an iteration later."""
    g = gate(stall_queue=1, stall_after_s=0.002, overload_wait_s=0.04)
    g.try_admit(0.0)
    t = busy_for(g, 0.1, 2.0)
    assert g.overloaded(t)
    g.waiting = 1                                     # only the running 20 ms call
    assert g.stall_excess(t, 0.003, 6) == 6 - 2       # back in 17 ms: ceil(23 / 20) = 2 stay
    assert g.stall_excess(t, 0.019, 6) == 6 - 2       # back in 1 ms: ceil(39 / 20) = 2 stay
    g.waiting = 2                                     # one more queued behind it
    assert g.stall_excess(t, 0.003, 6) == 6 - 1       # back in 37 ms: 1 stays
    g.waiting = 3                                     # two queued: the loop has its work
    assert g.stall_excess(t, 0.003, 6) == 6           # back in 57 ms: none stays, not even stall_queue
    g.waiting = 1
    assert g.stall_excess(t, 0.06, 6) == 6 - 1        # 3 x the learnt cost: back in ~60 ms, stall_queue


def test_stall_excess_leaves_nothing_while_the_loop_itself_refuses() -> None:
    """Issue 32: keep-alive requests already fill the loop's CPU and it refuses some: a connection
    left in the accept queue would get the same 503 from the loop a call and an iteration later
    (p50 66 ms at 2x), so the sentinel answers all of them while the loop refused in one of its last
    REFUSING_ITERATIONS iterations.  A sentinel's own refusals do not count (only the loop's)."""
    g = gate(stall_queue=1, stall_after_s=0.002, overload_wait_s=0.04)
    g.try_admit(0.0)
    t = busy_for(g, 0.1, 2.0)
    g.request_cpu_s = 0.02
    g.waiting = 1
    assert g.stall_excess(t, 0.003, 6) == 6 - 2       # no refusal by the loop: what it would admit stays
    g.note_shed(t)
    g.record_stall_shed(t, 4)
    assert g.stall_excess(t, 0.003, 6) == 6 - 2       # the sentinel's own 503s: unchanged
    for _ in range(3):                                 # the loop is refusing keep-alive requests
        g.waiting = 3
        r = g.try_admit(t, runnable=(3, 0))
    assert isinstance(r, Reject) and r.reason == "cpu"
    g.waiting = 1
    assert g.stall_excess(t + 0.05, 0.003, 6) == 6    # none stays, not even stall_queue
    assert g.stall_excess(t + 0.05, 0.0, 6) == 0      # (and never while the loop is not stalled)
    g.on_lag(t + 0.4, 0.3)                            # the iteration that refused ends, a long one:
    assert g.stall_excess(t + 0.4, 0.003, 6) == 6     # still refusing
    for i in range(1, REFUSING_ITERATIONS + 1):       # then iterations without a refusal
        assert g.stall_excess(t + 0.4, 0.003, 6) == 6
        g.on_lag(t + 0.4 + i * 0.02, 0.02)
    assert g.stall_excess(t + 0.5, 0.003, 6) == 6 - 2   # iterations without a refusal: it stopped
    r = g.try_admit(t + 0.5, runnable=(3, 0))
    assert isinstance(r, Reject)
    assert g.stall_excess(t + 0.5, 0.003, 6) == 6
    g.waiting = 1
    assert g.stall_excess(t + 1.6, 0.003, 6) == 6 - 2   # and overload_hold_s after the last one at most


def test_probe_period_short_while_busy_long_while_idle() -> None:
    g = gate()
    for i in range(10):
        g.on_lag(i * 0.01, 0.0)
    assert g.probe_delay() == 0.008
    g.on_lag(1.0, 0.004)
    assert g.probe_delay() == 0.001
    for i in range(2):                                 # quiet again: the period grows back ...
        g.on_lag(1.1 + i * 0.01, 0.0)
        assert g.probe_wanted()                        # ... while the probe keeps running
    g.on_lag(1.2, 0.0)
    assert g.probe_delay() == 0.008 and not g.probe_wanted()   # at the maximum, idle: it stops
    p = g.try_admit(1.25)                              # the next request of a sparse flow: no reset
    assert g.probe_delay() == 0.008
    g.release(1.251, p.permit)  # type: ignore[union-attr]
    g.on_lag(1.26, 0.0)
    assert not g.probe_wanted()                        # idle at the maximum: stopped again
    g.try_admit(2.5)                                   # new work after a quiet spell: short period
    assert g.probe_delay() == 0.001


def test_a_steady_flow_of_short_requests_keeps_a_slow_probe() -> None:
    g = gate()
    t = 0.0
    p = g.try_admit(t)
    for _ in range(20):                                # a request every 3 ms, each done in 0.1 ms
        g.release(t + 0.0001, p.permit)  # type: ignore[union-attr]
        t += 0.003
        g.on_lag(t, 0.0)
        p = g.try_admit(t)
    assert g.probe_delay() == 0.008                    # not reset to 1 ms by every admission


def test_a_late_probe_the_loop_did_not_cause_does_not_shorten_the_period() -> None:
    g = gate()
    for i in range(4):
        g.on_lag(i * 0.01, 0.0)
    g.on_lag(0.05, 0.005, loop_ran=0.0002)             # the process was not scheduled (more workers than CPUs)
    assert g.probe_delay() == 0.008
    g.on_lag(0.07, 0.005, loop_ran=0.015)              # the loop itself ran most of the time: busy
    assert g.probe_delay() == 0.001


@pytest.mark.parametrize("struct, key, value, expected", [
    (AdmissionSettings, "lag_target_s", -0.01, "> 0"),
    (AdmissionSettings, "lag_target_s", math.nan, "finite"),
    (AdmissionSettings, "cpu_concurrency", 0, ">= 1"),
    (AdmissionSettings, "stall_after_s", math.inf, "finite"),
    (AdmissionSettings, "stall_queue", -1, ">= 0"),
    (LimitsSettings, "slo_ms", -5.0, "> 0"),
    (LimitsSettings, "lease_s", -1.0, "> 0"),
    (LimitsSettings, "vegas_max_rps", math.inf, "finite"),
])
def test_settings_out_of_range_name_the_key(struct: type, key: str, value: object, expected: str) -> None:
    with pytest.raises(SettingError) as e:
        struct(**{key: value})
    assert e.value.key == key and expected in e.value.expected
    # and through msgspec (what the config loader sees): the key is in the message
    with pytest.raises(msgspec.ValidationError, match=rf"^{key} = .*expected"):
        msgspec.convert({key: value}, struct)


@pytest.mark.parametrize("struct, low, high", [
    (AdmissionSettings, "stall_after_s", "stall_idle_after_s"),
    (AdmissionSettings, "cpu_concurrency", "cpu_burst"),
    (LimitsSettings, "interval_s", "lease_s"),
    (LimitsSettings, "vegas_min_rps", "vegas_max_rps"),
])
def test_a_floor_above_its_ceiling_names_the_floor(struct: type, low: str, high: str) -> None:
    ceiling = getattr(struct(), high)
    above = ceiling * 2 if isinstance(ceiling, int) else (ceiling + 1.0) / 2 if ceiling < 1 else ceiling * 1.5
    with pytest.raises(SettingError) as e:
        struct(**{low: above})
    assert e.value.key == low and high in e.value.expected


def test_a_deep_accept_queue_shortens_the_stall_limit() -> None:
    """Issue 32: at the onset of an overload the loop has refused nothing yet; 11 connections
    waited behind its calls while the sentinel held to the idle limit (140-360 ms for their 503s)."""
    g = gate(stall_after_s=0.002, stall_idle_after_s=1.0, burst_wait_s=0.1, cpu_burst=8)
    assert g.stall_limit(0.0) == 1.0 and g.stall_limit(0.0, 4) == 1.0     # 4 x 20 ms: a burst may wait
    assert g.stall_limit(0.0, 7) == 1.0                                   # 7: fewer than a burst may start
    assert g.stall_limit(0.0, 8) == 0.002                                 # 8 x 20 ms: neither
    g.request_cpu_s = 0.002
    assert g.stall_limit(0.0, 40) == 1.0                                  # 40 x 2 ms fits a burst
    g.request_cpu_s = 0.02
    # requests admitted behind the call do not shorten it: awaits count as in flight too, and in
    # the systemd VM's stop under load (4 awaiting, 3 clients reconnecting) that shed a client
    g.waiting = 3
    g.try_admit(0.0)
    g.try_admit(0.0)
    assert g.inflight == 2 and g.stall_limit(0.0) == 1.0
