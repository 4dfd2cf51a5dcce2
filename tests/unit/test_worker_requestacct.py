"""One per-request accounting object (issue 33 item 2): ``RequestAcct`` on fakes, and the rule
that the request paths (the protocol's folded cycle, the ``Edge``, frames) do their per-request
counting and permit work through it only."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Any

import pytest

from numaserve.worker.requestacct import RequestAcct
from numaserve.worker.stats import WorkerStats

PKG = Path(__file__).resolve().parents[2] / "numaserve"


class FakePermit:
    def __init__(self, enqueued_at: float = 0.0) -> None:
        self.enqueued_at = enqueued_at


class FakeGate:
    def __init__(self, shedding: bool = False) -> None:
        self.released: list[tuple[float, Any, str]] = []
        self.gone: list[Any] = []
        self.sheds = shedding

    def shedding(self, now: float) -> bool:
        return self.sheds

    def release(self, now: float, permit: Any, outcome: str) -> None:
        self.released.append((now, permit, outcome))

    def client_gone(self, now: float, permit: Any) -> None:
        self.gone.append(permit)


class FakeCpu:
    def __init__(self, client_left: bool = False) -> None:
        self.client_left = client_left
        self.started_permits: list[Any] = []

    def client_gone(self, conn: Any) -> bool:
        return self.client_left

    def started(self, permit: Any, now: float) -> None:
        self.started_permits.append(permit)


class FakeEdge:
    def __init__(self, *, client_left: bool = False, shedding: bool = False,
                 close_when_overloaded: bool = False) -> None:
        self.stats: WorkerStats | None = WorkerStats()
        self.cpu = FakeCpu(client_left)
        self.gate = FakeGate(shedding)
        self.gone_after = 0.5
        self.close_when_overloaded = close_when_overloaded
        self.now = 10.0

    def clock(self) -> float:
        return self.now


def begun(edge: FakeEdge) -> RequestAcct:
    acct = RequestAcct()
    acct.begin(edge)  # type: ignore[arg-type]
    return acct


def test_counted_from_start_to_finish_with_latency_and_status() -> None:
    edge = FakeEdge()
    acct = begun(edge)
    assert edge.stats.inflight == 1
    assert acct.on_response_start(201) is False
    edge.now = 10.25
    acct.finish()
    assert edge.stats.inflight == 0 and edge.stats.requests == 1
    assert edge.stats.by_status == {201: 1}
    assert edge.stats.window.current.sum_ms == pytest.approx(250.0)


def test_no_response_counts_as_500() -> None:
    edge = FakeEdge()
    begun(edge).finish()
    assert edge.stats.by_status == {500: 1}


def test_without_stats_nothing_is_counted() -> None:
    edge = FakeEdge()
    edge.stats = None
    acct = begun(edge)
    acct.finish()   # no error, nothing to count


def test_the_permit_is_held_then_released_once_with_the_outcome() -> None:
    edge = FakeEdge()
    acct = begun(edge)
    p = FakePermit(enqueued_at=9.9)
    assert acct.hold(p, edge.now, conn=object())
    assert edge.cpu.started_permits == [p]
    acct.on_response_start(503)
    acct.finish()
    acct.finish()
    assert [(r[1], r[2]) for r in edge.gate.released] == [(p, "ignored")]


def test_a_request_whose_client_left_while_it_waited_is_not_run() -> None:
    edge = FakeEdge(client_left=True)
    acct = begun(edge)
    p = FakePermit(enqueued_at=edge.now - 1.0)   # waited past gone_after
    assert not acct.hold(p, edge.now, conn=object())
    assert edge.gate.gone == [p] and edge.cpu.started_permits == []
    acct.finish()
    assert edge.gate.released == []   # given back as "client gone", not released again


def test_a_recent_request_or_one_without_a_connection_is_not_checked() -> None:
    edge = FakeEdge(client_left=True)
    assert begun(edge).hold(FakePermit(enqueued_at=edge.now - 0.1), edge.now, conn=object())
    assert begun(edge).hold(FakePermit(enqueued_at=edge.now - 9.0), edge.now, conn=None)
    assert edge.gate.gone == []


def test_a_stream_gives_its_permit_back_at_its_first_chunk() -> None:
    edge = FakeEdge()
    acct = begun(edge)
    p = FakePermit()
    acct.hold(p, edge.now, conn=None)
    acct.streaming()
    acct.streaming()
    acct.finish()
    assert [(r[1], r[2]) for r in edge.gate.released] == [(p, "ok")]


def test_connection_close_while_draining_or_shedding_when_configured() -> None:
    assert begun(FakeEdge()).on_response_start(200) is False
    draining = FakeEdge()
    assert draining.stats is not None
    draining.stats.draining = True
    assert begun(draining).on_response_start(200) is True
    assert begun(FakeEdge(shedding=True)).on_response_start(200) is False
    assert begun(FakeEdge(shedding=True, close_when_overloaded=True)).on_response_start(200) is True


def _released_outcome(status: int, exc: BaseException | None = None, preset: str | None = None) -> str:
    edge = FakeEdge()
    acct = begun(edge)
    acct.hold(FakePermit(), edge.now, conn=None)
    acct.outcome = preset
    if status:
        acct.on_response_start(status)
    if exc is not None:
        acct.failed(exc)
    acct.finish()   # (judged here from the status when nothing set the outcome)
    return edge.gate.released[0][2]


@pytest.mark.parametrize(("status", "outcome"), [(200, "ok"), (404, "ok"), (400, "bad_request"),
                                                 (500, "ignored"), (503, "ignored"), (504, "dropped")])
def test_the_outcome_from_the_status(status: int, outcome: str) -> None:
    assert _released_outcome(status) == outcome


def test_an_app_that_answered_nothing_is_judged_before_uvicorns_500() -> None:
    edge = FakeEdge()
    acct = begun(edge)
    acct.hold(FakePermit(), edge.now, conn=None)
    acct.judge()                  # returned without a response
    acct.on_response_start(500)   # uvicorn's answer, after
    acct.finish()
    assert edge.gate.released[0][2] == "ok" and edge.stats is not None and edge.stats.by_status == {500: 1}


def test_the_outcome_from_an_exception_keeps_a_deadlines_drop() -> None:
    assert _released_outcome(0, ValueError("app")) == "ignored"
    assert _released_outcome(200, ValueError("app after its start")) == "ignored"
    assert _released_outcome(0, asyncio.CancelledError()) == "dropped"
    # the deadline passed (the edge set "dropped"), then the timeout propagated
    assert _released_outcome(0, TimeoutError(), preset="dropped") == "dropped"


#: The per-request work only ``RequestAcct`` does on the request paths.
ACCOUNTING_CALLS = ("request_finished", "request_started", "started")
REQUEST_PATHS = ("worker/httpproto.py", "worker/edge.py", "worker/sniff.py", "framing.py")


def accounting_outside(source: str) -> list[str]:
    """Per-request accounting done by hand in ``source``: counting in flight, the stats'
    request end, ``cpu.started``."""
    found = []
    for n in ast.walk(ast.parse(source)):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr in ACCOUNTING_CALLS):
            found.append(f"{n.lineno} {ast.unparse(n.func)}")
        elif (isinstance(n, ast.AugAssign) and isinstance(n.target, ast.Attribute)
              and n.target.attr == "inflight"):
            found.append(f"{n.lineno} {ast.unparse(n.target)} {'+=' if isinstance(n.op, ast.Add) else '-='}")
    return found


def test_the_finder_sees_hand_made_accounting() -> None:
    src = "stats.inflight += 1\nstats.request_finished(200, 1.0)\ncpu.started(p, 0.0)\nself._inflight += 1\n"
    assert accounting_outside(src) == ["1 stats.inflight +=", "2 stats.request_finished", "3 cpu.started"]


@pytest.mark.parametrize("rel", REQUEST_PATHS)
def test_request_paths_account_through_requestacct_only(rel: str) -> None:
    found = accounting_outside((PKG / rel).read_text())
    assert not found, f"numaserve/{rel} does per-request accounting by hand (use RequestAcct): {found}"
