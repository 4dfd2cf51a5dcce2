"""The worker's one edge layer (``numaserve.worker.edge.Edge``) with everything on, as the worker runs it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from numaserve.loops.admission import AdmissionSettings
from numaserve.worker.edge import Edge
from numaserve.worker.shedding import CONN_KEY, PERMIT_KEY, AdmissionRuntime
from numaserve.worker.stats import WorkerStats


class Conn:
    def __init__(self, *messages: dict[str, Any]) -> None:
        self.incoming = list(messages)
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if self.incoming:
            return self.incoming.pop(0)
        await asyncio.sleep(3600)
        raise AssertionError

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


def scope(headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/", "headers": headers or []}


def edge(app: Any, stats: WorkerStats, rt: AdmissionRuntime, max_body: int = 100, read_timeout: float = 5.0) -> Edge:
    return Edge(app, stats=stats, cpu=rt, max_body_bytes=max_body, read_timeout=read_timeout)


def runtime() -> AdmissionRuntime:
    return AdmissionRuntime(AdmissionSettings(sentinel=False))


def test_one_wrapper_counts_status_and_request_once() -> None:
    stats, rt = WorkerStats(), runtime()
    sends: list[Any] = []

    async def app(s: Any, receive: Any, send: Any) -> None:
        sends.append(send)
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    conn = Conn()
    asyncio.run(edge(app, stats, rt)(scope(), conn.receive, conn.send))
    assert [m["type"] for m in conn.sent] == ["http.response.start", "http.response.body"]
    assert stats.requests == 1 and stats.by_status == {201: 1} and stats.inflight == 0
    assert stats.cumulative.count == 1
    snap = rt.snapshot()
    assert snap["admitted"] == 1 and snap["ok"] == 1 and rt.gate.inflight == 0
    # the app got the edge's one wrapper, not a stack of them
    assert getattr(sends[0], "__self__", None).__class__.__name__ == "_Exchange"


def test_the_permit_is_released_when_a_stream_starts_not_when_it_ends() -> None:
    stats, rt = WorkerStats(), runtime()
    seen: list[int] = []

    async def app(s: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        seen.append(rt.gate.inflight)          # response started, no chunk yet: still held
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        seen.append(rt.gate.inflight)          # a stream now: released
        await asyncio.sleep(0.01)              # between chunks
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    conn = Conn()
    asyncio.run(edge(app, stats, rt)(scope(), conn.receive, conn.send))
    assert seen == [1, 0]
    assert rt.gate.inflight == 0 and rt.snapshot()["completed"] == 1   # released once
    assert stats.by_status == {200: 1} and len(conn.sent) == 4


def test_a_permit_left_by_the_protocol_is_used_and_released() -> None:
    stats, rt = WorkerStats(), runtime()
    d = rt.gate.try_admit(rt.clock())
    s = scope()
    s[PERMIT_KEY] = d.permit  # type: ignore[union-attr]

    async def app(sc: Any, receive: Any, send: Any) -> None:
        assert PERMIT_KEY not in sc and CONN_KEY not in sc   # the app never sees our keys
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    conn = Conn()
    asyncio.run(edge(app, stats, rt)(s, conn.receive, conn.send))
    assert rt.gate.inflight == 0 and rt.snapshot()["admitted"] == 1


def test_declared_body_over_the_limit_is_413_before_the_app_and_counted_once() -> None:
    stats, rt = WorkerStats(), runtime()
    ran: list[bool] = []

    async def app(s: Any, receive: Any, send: Any) -> None:
        ran.append(True)

    conn = Conn({"type": "http.request", "body": b"x" * 150, "more_body": False})
    asyncio.run(edge(app, stats, rt)(scope([(b"content-length", b"150")]), conn.receive, conn.send))
    assert not ran
    assert conn.sent[0]["status"] == 413 and (b"connection", b"close") in conn.sent[0]["headers"]
    assert conn.sent[-1]["more_body"] is False   # after the lingering read of the rest
    assert stats.rejected_body_too_large == 1 and stats.by_status == {413: 1} and stats.requests == 1
    assert rt.gate.inflight == 0


def test_streamed_body_over_the_limit_is_413_and_the_app_sees_a_disconnect() -> None:
    stats, rt = WorkerStats(), runtime()
    got: list[str] = []

    async def app(s: Any, receive: Any, send: Any) -> None:
        while True:
            m = await receive()
            got.append(m["type"])
            if m["type"] == "http.disconnect":
                await send({"type": "http.response.start", "status": 400, "headers": []})  # dropped
                return

    conn = Conn(*({"type": "http.request", "body": b"x" * 60, "more_body": True} for _ in range(3)))
    asyncio.run(edge(app, stats, rt)(scope([(b"transfer-encoding", b"chunked")]), conn.receive, conn.send))
    assert got == ["http.request", "http.disconnect"]
    assert conn.sent[0]["status"] == 413 and all(m.get("status") != 400 for m in conn.sent)
    assert stats.by_status == {413: 1} and stats.rejected_body_too_large == 1 and rt.gate.inflight == 0


def test_slow_body_is_408() -> None:
    stats, rt = WorkerStats(), runtime()

    async def app(s: Any, receive: Any, send: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    conn = Conn({"type": "http.request", "body": b"x", "more_body": True})
    asyncio.run(edge(app, stats, rt, read_timeout=0.05)(scope([(b"content-length", b"50")]), conn.receive, conn.send))
    assert conn.sent[0]["status"] == 408 and stats.rejected_read_timeout == 1 and stats.by_status == {408: 1}


def test_client_gone_while_waiting_is_not_run() -> None:
    stats, rt = WorkerStats(), runtime()
    ran: list[bool] = []

    class Gone:
        transport = None   # closed

    d = rt.gate.try_admit(rt.clock())
    d.permit.enqueued_at = time.monotonic() - 1.0  # type: ignore[union-attr]
    s = scope()
    s[PERMIT_KEY] = d.permit  # type: ignore[union-attr]
    s[CONN_KEY] = Gone()

    async def app(sc: Any, receive: Any, send: Any) -> None:
        ran.append(True)

    conn = Conn()
    asyncio.run(edge(app, stats, rt)(s, conn.receive, conn.send))
    assert not ran and not conn.sent and rt.gate.inflight == 0
    assert rt.gate.snapshot(rt.clock()).client_gone == 1


def test_app_exception_and_no_response_count_500_and_release() -> None:
    stats, rt = WorkerStats(), runtime()

    async def boom(s: Any, receive: Any, send: Any) -> None:
        raise ValueError("bug")

    async def silent(s: Any, receive: Any, send: Any) -> None:
        return

    conn = Conn()
    try:
        asyncio.run(edge(boom, stats, rt)(scope(), conn.receive, conn.send))
    except ValueError:
        pass
    else:
        raise AssertionError("the app's exception must reach the server (uvicorn answers 500)")
    asyncio.run(edge(silent, stats, rt)(scope(), conn.receive, conn.send))
    assert stats.by_status == {500: 2} and stats.inflight == 0 and rt.gate.inflight == 0
    assert rt.snapshot()["completed"] == 2


def test_draining_adds_connection_close_once() -> None:
    stats, rt = WorkerStats(), runtime()
    stats.draining = True

    async def app(s: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"connection", b"close")]})
        await send({"type": "http.response.body", "body": b""})

    conn = Conn()
    asyncio.run(edge(app, stats, rt)(scope(), conn.receive, conn.send))
    assert [k for k, _ in conn.sent[0]["headers"]].count(b"connection") == 1


def test_deadline_before_the_response_is_504() -> None:
    stats, rt = WorkerStats(), runtime()

    async def slow(s: Any, receive: Any, send: Any) -> None:
        await asyncio.sleep(5)

    conn = Conn()
    asyncio.run(edge(slow, stats, rt)(scope([(b"x-request-timeout", b"0.05")]), conn.receive, conn.send))
    assert conn.sent[0]["status"] == 504 and stats.by_status == {504: 1} and rt.gate.inflight == 0
    assert rt.snapshot()["status_504"] == 1   # the outcome the gate learns from: dropped


def test_proxy_headers_are_off_unless_configured_and_checked() -> None:
    import pytest

    from numaserve.config import ConfigError, load_config
    from numaserve.worker.serve import build_config
    from numaserve.worker.spec import WorkerSpec, flat_spec

    base = dict(slot=0, node=0, generation=1, cpus=[0], mempolicy="local", memory_nodes=[0], fd=-1, control="x")

    async def app(s: Any, r: Any, se: Any) -> None:
        pass

    assert build_config(WorkerSpec(**base), app).proxy_headers is False
    on = build_config(flat_spec(**base, proxy_headers=True, forwarded_allow_ips=["10.0.0.0/8"]), app)
    assert on.proxy_headers is True and on.forwarded_allow_ips == ["10.0.0.0/8"]
    with pytest.raises(ConfigError, match="forwarded_allow_ips"):
        load_config(None, {"server": {"forwarded_allow_ips": ["balancer"]}}, environ={}, use_default_path=False)
