"""Worker entry: placement self-check, stop/drain sequencing, exit codes."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import pytest

from numaserve.worker import main as wmain
from numaserve.worker.main import EXIT_APP_LOAD_FAILED, EXIT_ERROR, EXIT_OK, Worker, check_placement
from numaserve.worker.spec import SPEC_ENV, WorkerSpec, flat_spec


def make_spec(**kw: Any) -> WorkerSpec:
    base: dict[str, Any] = dict(slot=1, node=0, generation=2, cpus=sorted(os.sched_getaffinity(0)),
                                mempolicy="local", memory_nodes=[0], fd=-1,
                                control="ipc:///nonexistent", graceful_timeout=3.0)
    base.update(kw)
    return flat_spec(**base)


class NullLog:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None

    def bind(self, **kw: Any) -> "NullLog":
        return self


def test_exit_codes() -> None:
    assert (EXIT_OK, EXIT_ERROR, EXIT_APP_LOAD_FAILED) == (0, 1, 3)


def test_placement_without_verify_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "numaserve.bind.verify", None)  # import -> ImportError
    p = check_placement(make_spec())
    assert p.problems == ["mempolicy not checked: verify module missing"]
    assert p.cpus == sorted(os.sched_getaffinity(0)) and p.ok and p.mempolicy == "unchecked"
    p = check_placement(make_spec(cpus=[999]))
    assert not p.ok and any("999" in x for x in p.problems)


def test_placement_with_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    fake = types.ModuleType("numaserve.bind.verify")
    fake.check_self = lambda cpus, mp, nodes: (False, ["policy default, expected bind"], (0, 1), "default")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "numaserve.bind.verify", fake)
    p = check_placement(make_spec())
    assert (p.ok, p.cpus, p.mempolicy, p.problems) == (False, [0, 1], "default", ["policy default, expected bind"])

    def broken(*a: Any) -> Any:
        raise OSError("nope")

    fake.check_self = broken  # type: ignore[attr-defined]
    p = check_placement(make_spec())
    assert p.problems[0] == "verify failed: OSError: nope" and p.mempolicy == "unchecked"


class FakeServer:
    def __init__(self, worker: Worker, busy_for: float) -> None:
        self.events: list[str] = []
        self.connections = 1
        self.should_exit = False
        self.config = type("C", (), {"timeout_graceful_shutdown": 99.0})()
        self.worker = worker
        self.busy_until = time.monotonic() + busy_for
        self.went_idle = False                 # the in-flight work finished (seen by the worker)
        self.left_at_ws_close: float | None = None   # the worker's deadline left when websockets closed

    def stop_accepting(self) -> int:
        self.events.append("stop_accepting")
        return 1

    def shutdown_connections(self) -> int:
        self.events.append("shutdown_connections")
        return 1

    def close_websockets(self, code: int, reason: str) -> int:
        self.events.append(f"close_websockets {code}")
        self.left_at_ws_close = self.worker._remaining()
        n, self.websockets = self.websockets, 0
        return n

    websockets = 0

    @property
    def websocket_count(self) -> int:
        return self.websockets

    @property
    def connection_count(self) -> int:
        if time.monotonic() >= self.busy_until:
            self.worker.stats.inflight = 0
            self.went_idle = True
            return self.websockets
        return self.connections + self.websockets


def run_stop(busy_for: float, deadline: float, drain: bool = False,
             websockets: int = 0) -> tuple[Worker, FakeServer]:
    async def main() -> tuple[Worker, FakeServer]:
        w = Worker(make_spec(), NullLog())
        server = FakeServer(w, busy_for)
        server.websockets = websockets
        w.server = server  # type: ignore[assignment]
        w.stats.inflight = 1
        (w.request_drain(deadline) if drain else w.request_stop(deadline, "stopped"))
        assert w.stats.draining
        while not server.should_exit:
            await asyncio.sleep(0.01)
        return w, server

    return asyncio.run(main())


def test_stop_waits_for_inflight_then_tells_uvicorn() -> None:
    w, server = run_stop(busy_for=0.3, deadline=5)
    assert server.events == ["stop_accepting", "shutdown_connections", "close_websockets 1001"]
    assert server.went_idle and w.stats.inflight == 0   # uvicorn was told only after the work finished
    assert 4 < server.config.timeout_graceful_shutdown <= 5  # what is left of the deadline


def test_stop_gives_up_at_the_deadline() -> None:
    w, server = run_stop(busy_for=30, deadline=0.4, drain=True)
    assert not server.went_idle and w._stop_reason == "drained"   # ended by the deadline, work still running
    assert server.config.timeout_graceful_shutdown == 0.05  # uvicorn then cancels what is left


def test_websockets_get_the_whole_deadline_then_1001() -> None:
    """An open websocket keeps the drain going (like a stream) until the deadline; then it is
    closed with 1001 — not with uvicorn's 1012 when idle connections are shut."""
    _, server = run_stop(busy_for=0.1, deadline=0.8, websockets=1)
    assert server.events == ["stop_accepting", "shutdown_connections", "close_websockets 1001"]
    assert server.went_idle and server.websockets == 0
    assert server.left_at_ws_close is not None and server.left_at_ws_close <= 0.1  # at the deadline, not before


def test_second_request_tightens_deadline_and_stop_beats_drain() -> None:
    async def main() -> None:
        w = Worker(make_spec(), NullLog())  # no server yet: the sequence waits for run()
        w.request_drain(30)
        first = w._stop_deadline
        w.request_stop(60, "stopped")
        assert w._stop_deadline == first and w._stop_reason == "stopped"
        w.request_drain(1)
        assert w._stop_deadline is not None and first is not None and w._stop_deadline < first
        assert w._stop_reason == "stopped"

    asyncio.run(main())


def test_main_without_spec_exits_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(SPEC_ENV, raising=False)
    assert wmain.main() == EXIT_ERROR
    line = json.loads(capsys.readouterr().err.strip())
    assert line["event"] == "bad_worker_spec" and SPEC_ENV in line["error"]
