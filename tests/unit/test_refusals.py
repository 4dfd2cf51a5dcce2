"""Why this 503 (``numaserve.refusals``) and cheap refusals (issue 32).

Every refusal path names one reason of the fixed set in ``x-numaserve-refusal``,
the access log line and the counters status and the metric read; a refused
request whose body is in keeps its connection unless it must close.  Served the
way the worker serves (``build_stack`` on a real socket, raw HTTP) where the
connection matters; the gate's decisions themselves are tested in
``tests/unit/loops/test_loops_cpu_gate.py``: here a decision is forced (a pushed
ceiling of 0, or the gate's ``admit`` answering a given ``Reject``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from test_metrics import full_snapshot, samples, scrape
from worker_serving import start_serving

from numaserve.cli.ops_cmd import refusals_by_reason
from numaserve.control.messages import Stats
from numaserve.framing import FramingConfig
from numaserve.loops.admission import AdmissionSettings, Reject
from numaserve.loops.cpu_gate import CpuGate
from numaserve.refusals import (
    REFUSAL_HEADER,
    REFUSAL_REASONS,
    REFUSAL_STATUS,
    public_reason,
    refusal_header,
    refusal_of,
)
from numaserve.supervisor.metrics import NumaserveCollector
from numaserve.supervisor.slots import Totals
from numaserve.worker.edge import Edge, Stack, build_stack
from numaserve.worker.httpproto import connection_limit_503
from numaserve.worker.serve import WorkerServer
from numaserve.worker.shedding import AdmissionRuntime, overload_response
from numaserve.worker.spec import flat_spec
from numaserve.worker.stats import WorkerStats

#: The reasons the worker's gate decides (the others: the sentinel's and the connection limit's).
GATE_REASONS = ("cpu", "limit", "quota", "deadline")


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            m = await receive()
            await send({"type": m["type"] + ".complete"})
            if m["type"] == "lifespan.shutdown":
                return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    if scope["path"] == "/slow":
        await asyncio.sleep(1.0)
    out = b"%s %d" % (scope["path"].encode(), len(body))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(out))]})
    await send({"type": "http.response.body", "body": out})


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def access_lines() -> Iterator[list[str]]:
    logger = logging.getLogger("numaserve.access")
    cap = _Lines()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(cap)
    try:
        yield cap.lines
    finally:
        logger.removeHandler(cap)
        logger.setLevel(level)


@contextlib.asynccontextmanager
async def serving(**kw: Any) -> AsyncIterator[tuple[Stack, WorkerStats, tuple[str, int]]]:
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(64)
    kw.setdefault("admission", AdmissionSettings(sentinel=False))
    spec = flat_spec(slot=0, node=0, generation=1, cpus=[0], node_cpus=[0], mempolicy="local",
                     memory_nodes=[0], fd=-1, control="ipc:///nonexistent",
                     framing=FramingConfig(enabled=False), **kw)
    stats = WorkerStats()
    stack = build_stack(spec, app, stats)
    server = WorkerServer(stack.config)
    task = await start_serving(server, lst)
    try:
        yield stack, stats, lst.getsockname()
    finally:
        if stack.runtime is not None:
            stack.runtime.probe.stop()
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        lst.close()


def refuse_all(gate: CpuGate, epoch: int) -> None:
    """The supervisor pushes a ceiling of 0: every request is refused (``limit``)."""
    assert gate.set_limits(0.0, epoch, concurrency=0)


def lift(gate: CpuGate, epoch: int) -> None:
    """The overload is over: no ceiling."""
    assert gate.set_limits(0.0, epoch, concurrency=None)


async def response(r: asyncio.StreamReader, head_request: bool = False) -> tuple[bytes, dict[str, str], bytes]:
    """One HTTP/1.1 response with a declared length: (status line, headers, body)."""
    raw = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
    lines = raw[:-4].decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    n = 0 if head_request else int(headers.get("content-length", "0"))
    body = await asyncio.wait_for(r.readexactly(n), 5) if n else b""
    return lines[0].encode(), headers, body


async def closed(r: asyncio.StreamReader) -> bool:
    """The server closed the connection (EOF, with nothing more to read)."""
    return await asyncio.wait_for(r.read(), 5) == b""


# --- the set ------------------------------------------------------------------------------------


def test_the_set_is_small_fixed_and_each_reason_has_one_status() -> None:
    assert isinstance(REFUSAL_REASONS, tuple) and len(set(REFUSAL_REASONS)) == len(REFUSAL_REASONS) <= 8
    assert set(REFUSAL_STATUS) == set(REFUSAL_REASONS)
    assert {REFUSAL_STATUS[r] for r in REFUSAL_REASONS} == {429, 503, 504}
    assert all(refusal_header(r) == (REFUSAL_HEADER, r.encode()) for r in REFUSAL_REASONS)
    with pytest.raises(ValueError, match="unknown refusal reason 'overload': expected one of cpu, stalled"):
        refusal_header("overload")
    # the gate's names before the set was fixed map into it (counters of an older worker)
    assert [public_reason(n) for n in ("stall", "inflight_cap", "limit_zero", "cpu")] == \
        ["stalled", "limit", "limit", "cpu"]
    assert refusal_of([(b"X-Numaserve-Refusal", b"cpu")]) == "cpu" and refusal_of([(b"a", b"b")]) is None


def test_the_gate_counts_every_refusal_under_a_name_of_the_set() -> None:
    g = CpuGate(AdmissionSettings(max_inflight=1), 0.0)
    seen = set()
    p = g.admit(0.0)
    assert not isinstance(p, Reject)
    seen.add(g.admit(0.0).reason)                      # max_inflight
    g.release(0.0, p)
    g.set_limits(0.0, 1, rate=1.0, burst=1.0)
    p = g.admit(0.0)
    g.release(0.0, p)
    seen.add(g.admit(0.0).reason)                      # quota
    seen.add(g.admit(5.0, deadline=4.0).reason)        # deadline
    g.set_limits(5.0, 2, concurrency=0)
    seen.add(g.admit(5.0).reason)                      # pushed ceiling 0
    g.record_stall_shed(5.0, 2)                        # the sentinel's
    g.count_refusal("connections")                     # server.max_connections
    assert seen == {"limit", "quota", "deadline"}
    shed = g.snapshot(6.0).shed
    assert set(shed) <= set(REFUSAL_REASONS) and shed["stalled"] == 2 and shed["connections"] == 1
    assert shed["limit"] == 2
    with pytest.raises(KeyError):
        g.count_refusal("overload")


def test_status_and_the_metric_report_the_set() -> None:
    """What the workers count is what ``numaserve status`` and the metric label show; an older
    worker's names are mapped once, where the supervisor sums them."""
    t = Totals()
    t.add_stats(Stats(slot=0, generation=1, requests=0, inflight=0,
                      extra={"admission": {"shed": {"cpu": 4, "stalled": 2, "connections": 1}}}))
    t.add_stats(Stats(slot=0, generation=2, requests=0, inflight=0,
                      extra={"admission": {"shed": {"stall": 1, "inflight_cap": 3, "limit_zero": 1, "quota": 2}}}))
    assert t.shed_by_reason == {"cpu": 4, "stalled": 3, "connections": 1, "limit": 4, "quota": 2}
    snap = full_snapshot()
    snap["slots"][0]["totals"]["shed_by_reason"] = dict(t.shed_by_reason)
    assert refusals_by_reason({"slots": snap["slots"][:1]}) == \
        {"cpu": 4, "limit": 4, "stalled": 3, "quota": 2, "connections": 1}
    text = scrape(NumaserveCollector(lambda: snap, cpu_node={0: 0, 1: 1}))
    got = {labels["reason"]: v for labels, v in samples(text, "numaserve_shed_requests_by_reason_total", slot="0")}
    assert got == t.shed_by_reason and set(got) <= set(REFUSAL_REASONS)


# --- every refusal path answers with the reason ---------------------------------------------------


@pytest.mark.parametrize("reason", GATE_REASONS)
def test_the_protocols_refusal_names_the_reason_logs_it_and_keeps_the_connection(reason: str) -> None:
    """Refused at head-complete (no task, no ASGI call): the status of its reason, the header,
    ``refusal=`` in the access line, no ``Connection: close``; the next request on the same
    connection is served once the overload is over."""
    async def main() -> None:
        with access_lines() as lines:
            async with serving(access_log=True) as (stack, stats, addr):
                gate = stack.runtime.gate
                gate.admit = lambda now, deadline=None, runnable=(0, 0): Reject(  # type: ignore[method-assign]
                    REFUSAL_STATUS[reason], None if reason == "deadline" else 2, reason)
                r, w = await asyncio.open_connection(*addr)
                w.write(b"GET /r?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
                status, headers, body = await response(r)
                assert status.startswith(b"HTTP/1.1 %d " % REFUSAL_STATUS[reason])
                assert headers["x-numaserve-refusal"] == reason and "connection" not in headers
                assert reason.encode() in body
                del gate.admit   # the overload is over
                w.write(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
                status, headers, body = await response(r)
                assert status.startswith(b"HTTP/1.1 200 ") and body == b"/after 0"
                w.close()
                assert stats.requests == 1 and stack.runtime.gate.inflight == 0
        refused = [line for line in lines if f" refusal={reason}" in line]
        assert len(refused) == 1 and '"GET /r?x=1 HTTP/1.1"' in refused[0], lines
        assert f" {REFUSAL_STATUS[reason]} " in refused[0]
        assert any('"GET /after HTTP/1.1" 200' in line and "refusal" not in line for line in lines), lines

    asyncio.run(main())


def test_the_sentinels_503_names_stalled() -> None:
    raw = overload_response(1, "stalled")
    assert b"\r\nx-numaserve-refusal: stalled\r\n" in raw and b"connection: close" in raw


def test_the_edges_refusal_and_deadline_name_the_reason() -> None:
    """Requests the protocol did not decide (frames, h11, a pipelined request behind a running
    one) are refused by the edge, keeping the connection; a deadline passed while the app ran is
    ``deadline``."""
    async def main() -> None:
        rt = AdmissionRuntime(AdmissionSettings(sentinel=False))
        edge = Edge(app, cpu=rt)
        sent: list[Any] = []

        async def send(m: Any) -> None:
            sent.append(m)

        async def receive() -> Any:
            return {"type": "http.request", "body": b"", "more_body": False}

        def scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
            return {"type": "http", "method": "GET", "path": path, "headers": headers, "query_string": b""}

        refuse_all(rt.gate, 1)
        await edge(scope("/e", []), receive, send)
        start = sent[0]
        assert start["status"] == 503 and (REFUSAL_HEADER, b"limit") in start["headers"]
        assert not any(k == b"connection" for k, _ in start["headers"])
        lift(rt.gate, 2)
        sent.clear()
        await edge(scope("/slow", [(b"x-request-timeout", b"0.05")]), receive, send)
        assert sent[0]["status"] == 504 and (REFUSAL_HEADER, b"deadline") in sent[0]["headers"]
        rt.probe.stop()

    asyncio.run(main())


def test_the_connection_limit_names_connections_and_is_counted() -> None:
    async def main() -> None:
        sent: list[Any] = []

        async def send(m: Any) -> None:
            sent.append(m)

        await connection_limit_503({}, None, send)
        assert sent[0]["status"] == 503 and (REFUSAL_HEADER, b"connections") in sent[0]["headers"]
        async with serving(max_connections=2, keepalive_timeout=30) as (stack, _stats, addr):
            r, w = await asyncio.open_connection(*addr)   # at the limit with the next one
            w.write(b"GET /k HTTP/1.1\r\nHost: x\r\n\r\n")
            await response(r)
            r2, w2 = await asyncio.open_connection(*addr)
            w2.write(b"GET /l HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, _ = await response(r2)
            assert status.startswith(b"HTTP/1.1 503 ") and headers["x-numaserve-refusal"] == "connections"
            w.close()
            w2.close()
            assert stack.runtime.snapshot()["shed"] == {"connections": 1}

    asyncio.run(main())


# --- cheap refusals: the connection stays when it can ---------------------------------------------


def test_pipelined_refusals_are_answered_in_order_and_the_connection_serves_after() -> None:
    """Three requests in one write (a GET, a POST with its body, a HEAD), all refused: three
    answers in order on the open connection (the HEAD's without a body), then a 200 on it."""
    async def main() -> None:
        async with serving() as (stack, stats, addr):
            gate = stack.runtime.gate
            refuse_all(gate, 1)
            r, w = await asyncio.open_connection(*addr)
            w.write(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
                    b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
                    b"HEAD /c HTTP/1.1\r\nHost: x\r\n\r\n")
            for head_request in (False, False, True):
                status, headers, body = await response(r, head_request)
                assert status.startswith(b"HTTP/1.1 503 ") and headers["x-numaserve-refusal"] == "limit"
                assert "connection" not in headers and headers["retry-after"] in ("1", "2")
                assert (body == b"") == head_request
            lift(gate, 2)
            w.write(b"POST /d HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
            status, _, body = await response(r)
            assert status.startswith(b"HTTP/1.1 200 ") and body == b"/d 3"
            w.close()
            snap = stack.runtime.snapshot()
            assert snap["shed"] == {"limit": 3} and gate.inflight == 0 and stats.requests == 1

    asyncio.run(main())


@pytest.mark.parametrize("request_bytes, why", [
    (b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n", "the body is not in"),
    (b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nhalf", "half the body is in"),
    (b"GET /p HTTP/1.0\r\nHost: x\r\n\r\n", "HTTP/1.0"),
    (b"GET /p HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "the client closes"),
])
def test_a_refusal_closes_when_it_must(request_bytes: bytes, why: str) -> None:
    async def main() -> None:
        async with serving() as (stack, _stats, addr):
            refuse_all(stack.runtime.gate, 1)
            r, w = await asyncio.open_connection(*addr)
            w.write(request_bytes)
            status, headers, _ = await response(r)
            assert status.startswith(b"HTTP/1.1 503 "), why
            assert headers["connection"] == "close" and headers["x-numaserve-refusal"] == "limit", why
            assert await closed(r), why
            w.close()

    asyncio.run(main())


def test_close_when_overloaded_closes_refused_connections() -> None:
    async def main() -> None:
        adm = AdmissionSettings(sentinel=False, close_when_overloaded=True)
        async with serving(admission=adm) as (stack, _stats, addr):
            refuse_all(stack.runtime.gate, 1)
            r, w = await asyncio.open_connection(*addr)
            w.write(b"GET /p HTTP/1.1\r\nHost: x\r\n\r\n")
            _, headers, _ = await response(r)
            assert headers["connection"] == "close" and await closed(r)
            w.close()

    asyncio.run(main())
