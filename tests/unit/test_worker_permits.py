"""Permits by construction (issue 32): every admitted request gives its permit back.

Served the way the worker serves (``build_stack`` with the "cpu" limiter on a
real socket), raw HTTP from real client sockets: pipelined requests queued
behind a running one, connections closed or reset before their requests ran,
request tasks cancelled.  After every sequence the gate counts nothing in flight
and the audit (``numaserve.worker.permits``) finds no permit without a live owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from worker_serving import start_serving

from numaserve.framing import FramingConfig
from numaserve.loops.admission import AdmissionSettings
from numaserve.worker.edge import Stack, build_stack
from numaserve.worker.permits import audit
from numaserve.worker.serve import WorkerServer
from numaserve.worker.spec import flat_spec
from numaserve.worker.stats import WorkerStats


STREAMED: list[int] = []   # chunks each /stream request got out


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            m = await receive()
            await send({"type": m["type"] + ".complete"})
            if m["type"] == "lifespan.shutdown":
                return
    if scope["path"].startswith("/slow"):
        await asyncio.sleep(0.05)
    if scope["path"] == "/hold":
        await asyncio.sleep(0.3)
    if scope["path"] == "/stream":   # ?N: N chunks of 1 MiB (the frame reply limit's test)
        STREAMED.append(0)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        chunk = b"s" * (1 << 20)
        for _ in range(int(scope["query_string"] or 1)):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            STREAMED[-1] += 1
        await send({"type": "http.response.body", "body": b""})
        return
    out = scope["path"].encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(out))]})
    await send({"type": "http.response.body", "body": out})


@contextlib.asynccontextmanager
async def serving(**kw: Any) -> AsyncIterator[tuple[Stack, tuple[str, int]]]:
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(128)
    kw.setdefault("admission", AdmissionSettings(sentinel=False))
    kw.setdefault("framing", FramingConfig(enabled=False))
    spec = flat_spec(slot=0, node=0, generation=1, cpus=[0], node_cpus=[0], mempolicy="local",
                     memory_nodes=[0], fd=-1, control="ipc:///nonexistent", **kw)
    stack = build_stack(spec, app, WorkerStats())
    server = WorkerServer(stack.config)
    task = await start_serving(server, lst)
    try:
        yield stack, lst.getsockname()
    finally:
        stack.runtime.probe.stop()
        server.should_exit = True
        await asyncio.wait_for(task, 20)
        lst.close()


async def settled(stack: Stack) -> None:
    """Wait (generously) until nothing is in flight any more, then check the audit."""
    gate = stack.runtime.gate
    for _ in range(1000):
        if gate.inflight == 0:
            break
        await asyncio.sleep(0.01)
    report = audit(gate)
    assert report.orphans == 0, report
    assert gate.inflight == 0, report


def reset(w: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a client that gives up abruptly."""
    sock = w.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    w.close()


def test_pipelined_requests_closed_after_the_first_answer_give_their_permits_back() -> None:
    """The outage: 10 connections x 60 pipelined GETs, each closed after its first answer, left
    the gate counting ~560 in flight forever (then every request got 503 `limit`, then named inflight_cap)."""
    async def main() -> None:
        async with serving() as (stack, addr):
            async def one() -> None:
                r, w = await asyncio.open_connection(*addr)
                w.write(b"".join(b"GET /slow%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(60)))
                await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 20)   # the first answer (200, or 503 in the burst)
                w.close()
            await asyncio.gather(*(one() for _ in range(10)))
            await settled(stack)
            r, w = await asyncio.open_connection(*addr)
            w.write(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
            out = await asyncio.wait_for(r.readuntil(b"/after"), 20)
            assert out.startswith(b"HTTP/1.1 200 ")
            w.close()
            await settled(stack)

    asyncio.run(main())


def test_cancelled_request_tasks_give_their_permits_back() -> None:
    """A request task cancelled before or while it runs (a forced shutdown) still releases."""
    async def main() -> None:
        async with serving() as (stack, addr):
            conns = []
            for _ in range(3):
                r, w = await asyncio.open_connection(*addr)
                w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\nGET /slow2 HTTP/1.1\r\nHost: x\r\n\r\n")
                conns.append((r, w))
            gate = stack.runtime.gate
            for _ in range(1000):
                if gate.inflight >= 3:
                    break
                await asyncio.sleep(0.01)
            assert gate.inflight == 3   # the running ones: a pipelined request is admitted when it starts
            for t in [t for t in asyncio.all_tasks() if "run_asgi" in repr(t.get_coro())]:
                t.cancel()
            for _r, w in conns:
                w.close()
            await settled(stack)

    asyncio.run(main())


STEP = st.one_of(
    st.tuples(st.just("pipeline"), st.integers(1, 12), st.sampled_from(["close", "reset", "read"])),
    st.tuples(st.just("cancel"), st.integers(0, 3), st.just("")),
    st.tuples(st.just("half"), st.integers(1, 3), st.sampled_from(["close", "reset"])),
)


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(STEP, min_size=1, max_size=6))
# found by hypothesis: the running request cancelled with 10 pipelined behind it left them waiting
# forever, and the worker's graceful stop with them (the connection is closed now)
@example([("pipeline", 11, "read"), ("cancel", 0, ""), ("cancel", 0, ""), ("cancel", 1, "")])
def test_any_sequence_of_pipelining_resets_and_cancels_returns_in_flight_to_zero(steps: list[Any]) -> None:
    async def main() -> None:
        async with serving() as (stack, addr):
            open_conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
            for kind, n, how in steps:
                if kind == "cancel":   # cancel n running request tasks
                    tasks = [t for t in asyncio.all_tasks() if "run_asgi" in repr(t.get_coro())]
                    for t in tasks[:n]:
                        t.cancel()
                    await asyncio.sleep(0)
                    continue
                r, w = await asyncio.open_connection(*addr)
                reqs = b"".join(b"GET /slow%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(n))
                if kind == "half":   # the last request's head cut in the middle
                    reqs += b"GET /cut HTTP/1.1\r\nHo"
                w.write(reqs)
                if how == "read":
                    open_conns.append((r, w))
                    continue
                await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 20)   # the first answer (200, or 503 in the burst)
                if how == "reset":
                    reset(w)
                else:
                    w.close()
            for r, w in open_conns:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 20)   # the first answer (200, or 503 in the burst)
                w.close()
            await settled(stack)
            out_r, out_w = await asyncio.open_connection(*addr)
            out_w.write(b"GET /after HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await asyncio.wait_for(out_r.readuntil(b"/after"), 20)).startswith(b"HTTP/1.1 200 ")
            out_w.close()
            await settled(stack)

    asyncio.run(main())


def test_the_watch_releases_an_orphaned_permit_once_confirmed_and_logs_once(caplog: Any) -> None:
    """Production side: a permit whose owner is gone (a bug) is released at the second check
    that sees it, and the breach is logged once with the numbers."""
    import time

    from numaserve.loops.cpu_gate import CpuGate
    from numaserve.worker.permits import PermitWatch

    class Done:
        def done(self) -> bool:
            return True

    gate = CpuGate(AdmissionSettings(sentinel=False), time.monotonic())
    leaked = [gate.admit(time.monotonic()) for _ in range(3)]
    for p in leaked:
        p.task = Done()
    held = gate.admit(time.monotonic())   # owner unknown: not judged
    watch = PermitWatch()
    assert audit(gate).orphans == 3 and not audit(gate).ok
    assert watch.check(gate, time.monotonic()).orphans == 3 and gate.inflight == 4   # first sight: suspects
    with caplog.at_level("ERROR", logger="numaserve.worker"):
        watch.check(gate, time.monotonic())
        watch.check(gate, time.monotonic())
    assert gate.inflight == 1 and watch.released == 3 and audit(gate).ok
    errors = [r for r in caplog.records if "permit invariant broken" in r.getMessage()]
    assert len(errors) == 1 and "3 without a live owner" in errors[0].getMessage()
    gate.release(time.monotonic(), held)
    assert gate.inflight == 0 and audit(gate).ok
