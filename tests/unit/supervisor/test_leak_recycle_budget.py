"""Leak recycling is not budgeted to one worker per node per hour, and a deferred worker is recycled on its turn.

Before: of two workers leaking 50 kB per request on one node, the first was
recycled at 135 s and the second grew to 1.1 GB toward the soft cap (the
hourly budget was one); with tight caps a worker deferred behind another
operation waited for its next verdict and was killed at the hard cap.
"""

from __future__ import annotations

import asyncio
from collections import deque

import pytest
from slotfakes import FakeSlots, held_operation

from numaserve.config import Config
from numaserve.loops.leak import LeakSettings
from numaserve.supervisor import leakwatch as LW
from numaserve.supervisor.leakwatch import LeakWatch, recycle_deferral
from numaserve.supervisor.operations import Operations

MiB = 1 << 20
S = LeakSettings()   # production defaults: spacing 60 s, worker minimum 900 s, budget max(1, 2 // 2) = 1/hour


def _why(times: deque[float], now: float, grown: int, *, cap: bool = False, running: str | None = None,
         last_worker: float = -1e18) -> str | None:
    return recycle_deferral(S, now=now, node=0, times=times, last_worker=last_worker, cap=cap, shedding=False,
                            running_op=running, grown_bytes=grown, slots_on_node=2)


def test_a_second_leaking_worker_waits_for_spacing_not_for_the_hour() -> None:
    times: deque[float] = deque([100.0])            # the first worker was recycled at t=100
    assert "budget" in (_why(times, 200.0, 50 * MiB) or "")            # small growth: the budget may hold it
    assert "last recycle" in (_why(times, 130.0, 500 * MiB) or "")     # one at a time, spaced
    assert _why(times, 200.0, S.recycle_anyway_bytes) is None          # grown past the bound: recycled now
    # the bound does not depend on how many others leak: five recycles this hour change nothing
    assert _why(deque([100.0, 300.0, 500.0, 700.0, 900.0]), 1000.0, S.recycle_anyway_bytes) is None


def test_caps_skip_the_budget_but_never_overlap_an_operation() -> None:
    times: deque[float] = deque([100.0, 110.0])
    assert _why(times, 111.0, 0, cap=True) is None
    assert "operation op1 running" == _why(times, 111.0, 10 * S.recycle_anyway_bytes, cap=True, running="op1")


def test_old_recycles_leave_the_hourly_window() -> None:
    times: deque[float] = deque([0.0])
    assert _why(times, 3601.0, 0) is None and not times


@pytest.fixture
def rss(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    table: dict[int, int] = {}
    monkeypatch.setattr(LW, "read_statm_rss", lambda pid: table.get(pid))
    monkeypatch.setattr(LW, "read_smaps_rollup", lambda pid: {"Uss": table.get(pid, 0), "Pss": table.get(pid, 0)})
    return table


def _serving(cfg: Config) -> FakeSlots:
    f = FakeSlots(1, cfg=cfg, nodes=1, auto_ready=False)
    for slot in f.slots.values():
        f.start_worker(slot, 0.0)
        f.on_ready(slot, slot.worker, 0.5)
    f.auto_ready = True
    return f


def test_a_deferred_worker_is_recycled_at_the_first_tick_after_the_operation_ends(rss: dict[int, int]) -> None:
    async def main() -> None:
        f = _serving(Config())
        ops = Operations(f, f)
        other, gate = held_operation(ops, [0])
        lw = LeakWatch(f, f, ops, tuning=LeakSettings(uss_interval_s=0.0))
        lw.budget = 100 * MiB
        w = f.slots[0].worker
        rss[w.pid] = 90 * MiB                         # past the soft cap, under the hard one
        t = 0.0
        while (lw.last_verdicts.get(0) or {}).get("kind") != "soft_cap":
            t += 1.0
            lw.tick(t)
            assert t < 100, "no soft-cap verdict"
        assert ops.current is other
        gate.set()
        await other.done.wait()
        lw.tick(t + 1.0)                              # the next verdict is 30 s away
        assert ops.current is not other and ops.current.kind == "leak", ops.current
        assert ("kill", 1) not in f.calls
        await asyncio.wait_for(ops.current.done.wait(), 5)

    asyncio.run(main())
