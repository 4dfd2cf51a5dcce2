"""L0 admission machine on a virtual clock, its building blocks, and the asyncio wrapper."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numaserve.loops.admission import (
    Admit,
    AdmissionGate,
    AdmissionMachine,
    AdmissionSettings,
    CoDel,
    Grant,
    Queued,
    Reject,
    Rejected,
    Shed,
    TokenBucket,
)
from numaserve.loops.gradient import GradientController, GradientSettings


def machine(limit: int = 2, baseline: float = 0.020, **kw: object) -> AdmissionMachine:
    m = AdmissionMachine(AdmissionSettings(static_limit=limit, **kw), 0.0, rng=random.Random(7))  # type: ignore[arg-type]
    m.set_baseline(baseline)  # CoDel target = clamp(0.25 × 20 ms, 5, 100) = 5 ms
    return m


def test_admit_queue_then_reject_at_once() -> None:
    m = machine(limit=2)
    a = [m.try_admit(0.0) for _ in range(2)]
    assert all(isinstance(x, Admit) for x in a) and m.inflight == 2
    q = [m.try_admit(0.0) for _ in range(2)]  # queue bound = 1 × limit
    assert all(isinstance(x, Queued) for x in q) and m.queued == 2
    r = m.try_admit(0.0)
    assert isinstance(r, Reject) and r.status == 503 and r.reason == "queue_full"
    assert r.retry_after is not None and 1 <= r.retry_after <= 30
    # A release grants the oldest waiter (FIFO while not overloaded).
    out = m.release(0.002, a[0].permit)  # type: ignore[union-attr]
    assert len(out) == 1 and isinstance(out[0], Grant) and out[0].ticket is q[0].ticket  # type: ignore[union-attr]
    assert out[0].permit.queue_s == pytest.approx(0.002)
    st_ = m.snapshot(0.002)
    assert st_.admitted == 3 and st_.status_503 == 1 and st_.shed == {"queue_full": 1} and st_.queued == 1


def test_deadlines_give_504_at_admission_dequeue_and_expiry() -> None:
    m = machine(limit=1, max_wait_factor=0.0)
    assert isinstance(m.try_admit(0.0), Admit)
    r = m.try_admit(1.0, deadline=1.0)
    assert isinstance(r, Reject) and r.status == 504 and r.retry_after is None
    q = m.try_admit(1.0, deadline=1.5)
    assert isinstance(q, Queued)
    assert q.ticket.expires_at == pytest.approx(1.5 - 0.020)  # deadline minus the baseline service time
    out = m.poll(1.49)
    assert len(out) == 1 and isinstance(out[0], Shed) and out[0].reject.status == 504
    assert m.queued == 0 and m.snapshot(1.49).status_504 == 2
    assert m.on_dequeue_check(2.0, 1.0, deadline=1.9) == Reject(504, None, "deadline")


def test_max_wait_sheds_with_503() -> None:
    m = machine(limit=1)  # target 5 ms, max wait 1 × target
    m.try_admit(0.0)
    q = m.try_admit(0.0)
    assert isinstance(q, Queued) and q.ticket.expires_at == pytest.approx(0.005)
    assert m.next_expiry() == pytest.approx(0.005)
    assert m.poll(0.004) == []
    out = m.poll(0.006)
    assert isinstance(out[0], Shed) and out[0].reject.status == 503 and out[0].reject.reason == "max_wait"


def test_codel_overload_turns_lifo_and_sloughs_old_waiters() -> None:
    m = machine(limit=1, max_wait_factor=0.0, queue_factor=10.0)
    held = m.try_admit(0.0)
    assert isinstance(held, Admit)
    tickets = [m.try_admit(0.001 * i) for i in range(1, 9)]
    # The first interval saw the immediate admission (delay 0): not overloaded.  The next
    # one only sees a standing queue (min delay 149 ms > 5 ms) ...
    out = m.release(0.15, held.permit)
    assert isinstance(out[0], Grant) and not m.codel.overloaded
    out = m.release(0.3, out[0].permit)  # interval over: overloaded from now on
    assert m.codel.overloaded
    # ... so the newest waiter goes first (LIFO) and every waiter older than 2 × target is shed.
    kinds = [(type(d).__name__, getattr(d, "reject", None) and d.reject.reason) for d in out]
    assert kinds[0] == ("Shed", "codel")
    assert all(k == ("Shed", "codel") for k in kinds)
    assert m.queued == 0 and len(out) == len(tickets) - 1
    fresh = m.try_admit(0.3)
    assert isinstance(fresh, Admit)
    older, newer = m.try_admit(0.301), m.try_admit(0.302)
    out = m.release(0.305, fresh.permit)
    assert isinstance(out[0], Grant) and out[0].ticket is newer.ticket  # type: ignore[union-attr]
    assert m.queued == 1 and older.ticket.id in m._live  # type: ignore[union-attr]


def test_codel_unit() -> None:
    c = CoDel(0.1, 0.005, 2.0, 0.0)
    assert not c.observe(0.01, 0.5)  # not overloaded in the first interval
    assert c.observe(0.2, 0.02)  # interval ended with min 0.5 > target: overloaded, 20 ms > slough 10 ms
    assert not c.observe(0.21, 0.008)  # under slough: kept
    assert c.load() == pytest.approx(80.0)
    c.observe(0.4, 0.0)  # last interval's min was 8 ms > 5 ms: still overloaded
    assert c.overloaded
    c.observe(0.6, 0.0)
    assert not c.overloaded


def test_token_bucket_quota_429_with_retry_after() -> None:
    m = machine(limit=100)
    assert m.set_limits(0.0, 1, rate=10.0, burst=2.0)
    assert all(isinstance(m.try_admit(0.0), Admit) for _ in range(2))
    r = m.try_admit(0.0)
    assert isinstance(r, Reject) and r.status == 429 and r.reason == "quota" and r.retry_after == 1
    assert isinstance(m.try_admit(0.1), Admit)
    m.set_limits(0.1, 2, rate=1.0, burst=1.0)
    m.try_admit(0.1)
    r = m.try_admit(0.1)
    assert isinstance(r, Reject) and r.retry_after == 1
    m.set_limits(0.2, 3, rate=0.2)  # burst defaults to max(1, 10 % of rate)
    assert m.snapshot(0.2).burst == 1.0


@settings(max_examples=80, deadline=None)
@given(st.floats(0.5, 500), st.floats(1, 50), st.lists(st.floats(0, 0.05), min_size=1, max_size=150))
def test_token_bucket_never_exceeds_rate_times_t_plus_burst(rate: float, burst: float, gaps: list[float]) -> None:
    b = TokenBucket(rate, burst, 0.0)
    now = 0.0
    taken: list[float] = []
    for g in gaps:
        now += g
        for _ in range(3):
            if b.try_take(now):
                taken.append(now)
    for i in range(len(taken)):
        for j in range(i, len(taken)):
            assert j - i + 1 <= rate * (taken[j] - taken[i]) + max(1.0, burst) + 1e-6


def test_lease_ceiling_safe_value_and_epochs() -> None:
    ctl = GradientController(GradientSettings(initial_limit=40), 0.0)
    m = AdmissionMachine(AdmissionSettings(), 0.0, controller=ctl)
    assert m.limit(0.0) == 10  # probing: ceil(40/4)
    ctl._probing = False  # finish the probe for the test
    assert m.limit(0.0) == 40
    assert m.set_limits(0.0, 5, concurrency=8, lease_expiry=10.0, safe_concurrency=3)
    assert m.limit(9.9) == 8 and m.limit(10.1) == 3  # min(L1, ceiling); safe value after expiry
    assert m.snapshot(10.1).lease_expired
    assert not m.set_limits(11.0, 4, concurrency=100)  # stale epoch: ignored
    assert m.limit(11.0) == 3 and m.epoch == 5
    assert m.set_limits(11.0, 5, concurrency=8, lease_expiry=20.0)  # same epoch renews
    assert m.limit(19.0) == 8 and m.limit(21.0) == 8  # no safe value: keeps the last ceiling
    m.set_limits(21.0, 6, concurrency=0)
    r = m.try_admit(21.0)
    assert isinstance(r, Reject) and r.status == 503


def test_outcomes_counted_and_double_release_is_harmless() -> None:
    m = machine(limit=10)
    permits = [m.try_admit(0.0).permit for _ in range(4)]  # type: ignore[union-attr]
    for p, o in zip(permits, ["ok", "dropped", "ignored", "bad_request"]):
        m.release(0.01, p, o)  # type: ignore[arg-type]
    m.release(0.02, permits[0])
    s = m.snapshot(0.02, reset_max=True)
    assert (s.ok, s.status_504, s.status_500, s.status_400, s.completed) == (1, 1, 1, 1, 4)
    assert s.inflight == 0 and s.max_inflight == 4 and m.snapshot(0.02).max_inflight == 0
    msgspec.json.encode(s)


def test_retry_after_follows_queue_over_throughput() -> None:
    m = machine(limit=1, queue_factor=100.0, max_wait_factor=0.0)
    now = 0.0
    p = m.try_admit(now).permit  # type: ignore[union-attr]
    for _ in range(100):  # 10 completions per second for 10 s
        now += 0.1
        m.release(now, p)
        p = m.try_admit(now).permit  # type: ignore[union-attr]
    for _ in range(50):
        assert isinstance(m.try_admit(now), Queued)
    tput = m.snapshot(now).throughput
    assert 9.0 < tput < 10.5
    expected = int(50 / tput) + 1
    values = {m._overload_retry(now) for _ in range(50)}
    assert values <= {expected, expected + 1} and min(values) >= 5


def test_cancel_removes_a_waiter() -> None:
    m = machine(limit=1)
    held = m.try_admit(0.0)
    q = m.try_admit(0.0)
    assert isinstance(q, Queued) and m.cancel(0.001, q.ticket) and m.queued == 0
    assert not m.cancel(0.001, q.ticket)
    assert m.release(0.002, held.permit) == []  # type: ignore[union-attr]


def test_settings_section() -> None:
    s = msgspec.convert({"queue_factor": 2.0}, AdmissionSettings)
    assert s.queue_factor == 2.0 and s.codel_interval_s == 0.1 and s.max_wait_factor == 1.0
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"queue": 1}, AdmissionSettings)
    with pytest.raises(ValueError):
        AdmissionSettings(codel_target_min_s=0.2, codel_target_max_s=0.1)


def test_asyncio_gate_wrapper() -> None:
    async def main() -> None:
        m = AdmissionMachine(AdmissionSettings(static_limit=1, max_wait_factor=0.0), 0.0)
        m.set_baseline(0.2)  # target 50 ms
        gate = AdmissionGate(m)
        order: list[str] = []

        async def job(name: str, hold: float) -> None:
            async with gate.admit() as permit:
                order.append(f"start {name}")
                await asyncio.sleep(hold)
                assert permit.inflight_at_start == 1

        first = asyncio.create_task(job("a", 0.05))
        await asyncio.sleep(0)
        second = asyncio.create_task(job("b", 0.0))
        await asyncio.sleep(0)
        with pytest.raises(Rejected) as exc:  # queue bound 1 × limit: full
            async with gate.admit():
                pass
        assert exc.value.status == 503 and exc.value.headers()[0][0] == b"retry-after"
        await asyncio.gather(first, second)
        assert order == ["start a", "start b"]

        with pytest.raises(ValueError):
            async with gate.admit():
                raise ValueError("boom")
        assert m.snapshot(0.0).status_500 == 1

        # A waiter whose deadline comes first leaves with 504 via its own timer.
        m.s = AdmissionSettings(static_limit=1)  # max wait back on (1 × 50 ms)
        hold = asyncio.create_task(job("c", 0.2))
        await asyncio.sleep(0)
        with pytest.raises(Rejected) as exc:
            async with gate.admit(deadline=gate.clock() + 0.22):
                pass
        assert exc.value.status in (503, 504)
        await hold
        # A cancelled waiter leaves the queue.
        m.s = AdmissionSettings(static_limit=1, max_wait_factor=0.0)
        hold = asyncio.create_task(job("d", 0.05))
        await asyncio.sleep(0)
        waiter = asyncio.create_task(job("e", 0.0))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await hold
        assert m.queued == 0 and m.inflight == 0
        gate.tick()
        assert gate.set_limits(1, concurrency=5)

    asyncio.run(asyncio.wait_for(main(), 5))
