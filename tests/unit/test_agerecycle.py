"""supervisor.agerecycle: per-worker jittered limits, and one recycle at a time through operations."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

from numaserve.config import load_config
from numaserve.supervisor import slots as S
from numaserve.supervisor.agerecycle import LIFETIME_JITTER, AgeRecycle, Limits, draw_limits, due_reason


def test_limits_are_drawn_within_the_jitter_and_differ_between_workers() -> None:
    rng = random.Random(7)
    drawn = [draw_limits(g, 1000, 50, 600.0, rng) for g in range(200)]
    assert all(1000 <= d.requests <= 1050 for d in drawn)
    assert all(600.0 <= d.lifetime <= 600.0 * (1 + LIFETIME_JITTER) for d in drawn)
    assert len({d.requests for d in drawn}) > 10 and len({d.lifetime for d in drawn}) > 10
    assert draw_limits(1, 0, 0, 0.0, rng) == Limits(1, 0, 0.0)
    assert draw_limits(1, 10, 0, 0.0, rng).requests == 10


def test_due_reason_names_the_limit() -> None:
    lim = Limits(1, 100, 60.0)
    assert due_reason(lim, 99, 59.0) is None
    assert due_reason(lim, 100, 1.0) == "max_requests: 100 requests served (limit 100)"
    assert (due_reason(lim, 5, 61.0) or "").startswith("max_lifetime: up 61s")
    assert due_reason(Limits(1, 0, 0.0), 10**9, 1e9) is None


class FakeOps:
    def __init__(self) -> None:
        self.current: Any = None
        self.started: list[tuple[str, dict[str, Any], list[int]]] = []

    def start(self, kind: str, args: dict[str, Any], slots: list[int], body: Any) -> Any:
        self.started.append((kind, args, slots))
        self.current = SimpleNamespace(state="running", kind=kind, on_finish=[], result="")
        return self.current

    def finish(self, state: str) -> None:
        self.current.state = state
        for cb in self.current.on_finish:
            cb(self.current)


def _slot(n: int, requests: int, *, state: str = S.READY, generation: int = 1) -> Any:
    w = SimpleNamespace(pid=100 + n, generation=generation, ready=1.0, stop_sent=None, started=0.0,
                        stats=SimpleNamespace(requests=requests))
    return SimpleNamespace(plan=SimpleNamespace(slot=n, node=0), state=state, drained=False, incoming=None, worker=w)


def _ctl(slots: list[Any], **worker: Any) -> Any:
    cfg = load_config(None, {"worker": worker}, environ={}, use_default_path=False)
    return SimpleNamespace(cfg=cfg, stopping=False, slots={s.plan.slot: s for s in slots})


def test_one_recycle_at_a_time_and_only_of_a_serving_worker() -> None:
    slots = [_slot(0, 500, state=S.STARTING), _slot(1, 499), _slot(2, 700), _slot(3, 900)]
    ops = FakeOps()
    rec = AgeRecycle(_ctl(slots, max_requests=500), ops)  # type: ignore[arg-type]
    rec.tick(10.0)
    assert [(k, s) for k, _, s in ops.started] == [("max_requests", [2])]   # not starting slot 0, not 499
    rec.tick(11.0)
    assert len(ops.started) == 1            # an operation runs: nothing else starts
    ops.finish("succeeded")
    slots[2].worker = _slot(2, 0, generation=2).worker   # replaced: fresh limits, count from 0
    rec.tick(12.0)
    assert [s for _, _, s in ops.started] == [[2], [3]]


def test_lifetime_uses_the_worker_start_and_off_means_never() -> None:
    ops = FakeOps()
    AgeRecycle(_ctl([_slot(0, 10**6)]), ops).tick(1e6)  # type: ignore[arg-type]
    assert ops.started == []
    rec = AgeRecycle(_ctl([_slot(0, 0)], max_lifetime=100.0), ops)  # type: ignore[arg-type]
    rec.tick(99.0)
    assert ops.started == []
    rec.tick(111.0)
    assert ops.started and ops.started[0][0] == "max_lifetime"


def test_a_failed_recycle_is_not_retried_at_once(monkeypatch: Any) -> None:
    import numaserve.supervisor.agerecycle as A

    monkeypatch.setattr(A.time, "monotonic", lambda: 1000.0)
    ops = FakeOps()
    rec = AgeRecycle(_ctl([_slot(0, 10)], max_requests=5), ops)  # type: ignore[arg-type]
    rec.tick(1000.0)
    ops.finish("failed")           # the new worker never got ready: the old one still serves
    rec.tick(1001.0)
    assert len(ops.started) == 1
    rec.tick(1000.0 + A.RETRY_AFTER_FAILURE)
    assert len(ops.started) == 2
