"""The worker's HTTP protocol with the edge folded into its request cycle (``LeanCycle.run_asgi``).

Served the way the worker serves: ``build_stack`` (every default on: the "cpu"
limiter, metrics, body limits) on a real socket, raw HTTP from a client.  Each
test checks that the folded path did the edge's work (counts, the permit,
``Connection: close``) and that the requests it leaves to the ``Edge`` (a body
still arriving, a deadline, proxy headers) still get it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import socket
from collections.abc import AsyncIterator
from typing import Any

from worker_serving import start_serving

from numaserve.framing import FramingConfig
from numaserve.loops.admission import AdmissionSettings
from numaserve.worker.edge import Stack, build_stack
from numaserve.worker.serve import WorkerServer
from numaserve.worker.spec import flat_spec
from numaserve.worker.stats import WorkerStats

SEEN: dict[str, Any] = {}
VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            m = await receive()
            if m["type"] == "lifespan.startup":
                VAR.set("lifespan")
            await send({"type": m["type"] + ".complete"})
            if m["type"] == "lifespan.shutdown":
                return
    path = scope["path"]
    SEEN["send"] = send
    SEEN["var"] = VAR.get()
    SEEN["client"] = scope["client"]
    if path == "/boom":
        raise RuntimeError("boom")
    if path == "/none":
        return
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(3):
            await send({"type": "http.response.body", "body": b"data: %d\n\n" % i, "more_body": True})
            SEEN.setdefault("inflight", []).append(SEEN["gate"].inflight)
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    body = b""
    if scope["method"] == "POST":
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
    out = b"%s %d" % (path.encode(), len(body))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(out))]})
    await send({"type": "http.response.body", "body": out})


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
    if stack.runtime is not None:
        SEEN["gate"] = stack.runtime.gate
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


async def exchange(addr: tuple[str, int], raw: bytes, until: bytes = b"") -> bytes:
    """Send ``raw``; read to EOF (or until ``until`` is seen)."""
    r, w = await asyncio.open_connection(*addr)
    w.write(raw)
    try:
        if until:
            return await asyncio.wait_for(r.readuntil(until), 5)
        return await asyncio.wait_for(r.read(), 5)
    finally:
        w.close()


def head_of(out: bytes) -> dict[str, str]:
    lines = out.split(b"\r\n\r\n")[0].decode().split("\r\n")[1:]
    return {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}


def test_a_get_is_counted_admitted_and_released_without_the_edge_wrapper() -> None:
    async def main() -> None:
        async with serving() as (stack, stats, addr):
            r, w = await asyncio.open_connection(*addr)
            for i in range(3):   # keep-alive: three on one connection
                w.write(b"GET /a%d HTTP/1.1\r\nHost: x\r\n\r\n" % i)
                out = await asyncio.wait_for(r.readuntil(b"/a%d 0" % i), 5)
                assert out.startswith(b"HTTP/1.1 200 ") and "connection" not in head_of(out)
            w.close()
            # the app got the protocol's own send: the edge's work was done in the cycle
            assert type(SEEN["send"].__self__).__name__ == "LeanCycle"
            assert stats.requests == 3 and stats.by_status == {200: 3} and stats.inflight == 0
            assert stats.cumulative.count == 3
            snap = stack.runtime.snapshot()
            assert snap["admitted"] == 3 and snap["ok"] == 3 and stack.runtime.gate.inflight == 0
            assert snap["delay_count"] == 3

    asyncio.run(main())


def test_a_stream_holds_no_permit_between_chunks() -> None:
    async def main() -> None:
        SEEN.pop("inflight", None)
        async with serving() as (stack, stats, addr):
            out = await exchange(addr, b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n", until=b"0\r\n\r\n")
            assert head_of(out)["transfer-encoding"] == "chunked"
            assert out.split(b"\r\n\r\n", 1)[1] == b"9\r\ndata: 0\n\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"
            assert SEEN["inflight"] == [0, 0, 0]
            snap = stack.runtime.snapshot()
            assert snap["admitted"] == 1 and snap["ok"] == 1 and stack.runtime.gate.inflight == 0
            assert stats.by_status == {200: 1}

    asyncio.run(main())


def test_an_app_error_and_a_missing_response_are_500_counted_and_released() -> None:
    async def main() -> None:
        async with serving() as (stack, stats, addr):
            for path in (b"/boom", b"/none"):
                out = await exchange(addr, b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path)
                assert out.startswith(b"HTTP/1.1 500 ")
            assert stats.by_status == {500: 2} and stats.inflight == 0
            snap = stack.runtime.snapshot()
            assert snap["admitted"] == 2 and snap["completed"] == 2 and stack.runtime.gate.inflight == 0
            assert snap["status_500"] == 1   # the exception; the silent app counts as the edge counts it

    asyncio.run(main())


def test_draining_says_connection_close_and_closes() -> None:
    async def main() -> None:
        async with serving() as (_stack, stats, addr):
            stats.draining = True
            out = await exchange(addr, b"GET /d HTTP/1.1\r\nHost: x\r\n\r\n")   # read to EOF: closed
            assert out.endswith(b"/d 0") and head_of(out)["connection"] == "close"

    asyncio.run(main())


def test_bodies_complete_or_arriving_and_the_body_limit() -> None:
    async def main() -> None:
        async with serving(max_body_bytes=10) as (stack, stats, addr):
            # in with its head: folded
            out = await exchange(addr, b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
                                 until=b"/p 5")
            assert out.startswith(b"HTTP/1.1 200 ")
            # arriving later: the edge's limited receive
            r, w = await asyncio.open_connection(*addr)
            w.write(b"POST /q HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nhel")
            await asyncio.sleep(0.05)
            w.write(b"lo!")
            assert (await asyncio.wait_for(r.readuntil(b"/q 6"), 5)).startswith(b"HTTP/1.1 200 ")
            w.close()
            # over the limit, declared: 413 from the edge, the app not run
            out = await exchange(addr, b"POST /r HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\nhello world")
            assert out.startswith(b"HTTP/1.1 413 ")
            assert stats.by_status == {200: 2, 413: 1} and stats.rejected_body_too_large == 1
            assert stack.runtime.gate.inflight == 0

    asyncio.run(main())


def test_a_deadline_runs_through_the_edge_and_still_answers() -> None:
    async def main() -> None:
        async with serving() as (stack, stats, addr):
            out = await exchange(addr, b"GET /t HTTP/1.1\r\nHost: x\r\nx-request-timeout: 5\r\n\r\n", until=b"/t 0")
            assert out.startswith(b"HTTP/1.1 200 ")
            assert type(SEEN["send"].__self__).__name__ == "_Exchange"   # the edge's wrapper
            assert stats.by_status == {200: 1} and stack.runtime.gate.inflight == 0

    asyncio.run(main())


def test_admission_off_is_folded_too() -> None:
    async def main() -> None:
        async with serving(admission=AdmissionSettings(enabled=False)) as (stack, stats, addr):
            assert stack.runtime is None
            out = await exchange(addr, b"GET /o HTTP/1.1\r\nHost: x\r\n\r\n", until=b"/o 0")
            assert out.startswith(b"HTTP/1.1 200 ")
            assert type(SEEN["send"].__self__).__name__ == "LeanCycle"
            assert stats.by_status == {200: 1} and stats.inflight == 0

    asyncio.run(main())


def test_proxy_headers_wrap_the_edge_and_are_applied() -> None:
    async def main() -> None:
        async with serving(proxy_headers=True, forwarded_allow_ips=("127.0.0.1",)) as (_s, stats, addr):
            out = await exchange(addr, b"GET /x HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 10.1.2.3\r\n\r\n",
                                 until=b"/x 0")
            assert out.startswith(b"HTTP/1.1 200 ") and SEEN["client"][0] == "10.1.2.3"
            assert stats.by_status == {200: 1}

    asyncio.run(main())


def test_requests_do_not_see_the_lifespans_context() -> None:
    async def main() -> None:
        async with serving() as (_s, _stats, addr):
            await exchange(addr, b"GET /v HTTP/1.1\r\nHost: x\r\n\r\n", until=b"/v 0")
            assert SEEN["var"] == "unset"   # a task per request in a copy of the loop's context

    asyncio.run(main())


def test_the_connection_limit_503_gives_the_permit_back() -> None:
    async def main() -> None:
        async with serving(max_connections=2, keepalive_timeout=30) as (stack, _stats, addr):
            r, w = await asyncio.open_connection(*addr)   # at the limit with the next one
            w.write(b"GET /k HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(r.readuntil(b"/k 0"), 5)
            out = await exchange(addr, b"GET /l HTTP/1.1\r\nHost: x\r\n\r\n")
            assert out.startswith(b"HTTP/1.1 503 ")
            w.close()
            assert stack.runtime.gate.inflight == 0
            assert stack.runtime.snapshot()["admitted"] == 2

    asyncio.run(main())


def test_a_default_deadline_runs_through_the_edge() -> None:
    async def main() -> None:
        async with serving(admission=AdmissionSettings(sentinel=False, request_timeout_s=5.0)) as (stack, _st, addr):
            out = await exchange(addr, b"GET /u HTTP/1.1\r\nHost: x\r\n\r\n", until=b"/u 0")
            assert out.startswith(b"HTTP/1.1 200 ") and type(SEEN["send"].__self__).__name__ == "_Exchange"
            assert stack.runtime.gate.inflight == 0

    asyncio.run(main())


def test_expect_100_continue_is_answered_before_the_body() -> None:
    async def main() -> None:
        async with serving() as (_stack, stats, addr):
            r, w = await asyncio.open_connection(*addr)
            w.write(b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
            assert await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
            w.write(b"body")
            assert (await asyncio.wait_for(r.readuntil(b"/e 4"), 5)).startswith(b"HTTP/1.1 200 ")
            w.close()
            assert stats.by_status == {200: 1}

    asyncio.run(main())
