"""The "cpu" limiter's shell in-process: the protocol's decision, the middleware, the sentinel."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from worker_serving import start_serving

from numaserve.framing import FramingConfig
from numaserve.loops.admission import AdmissionSettings
from numaserve.worker.admission_mw import CpuAdmissionMiddleware
from numaserve.worker.serve import WorkerServer, build_config
from numaserve.worker.shedding import (
    AdmissionRuntime,
    overload_response,
    RUNNABLE_REFRESH_S,
    RunnableCount,
    runnable_tasks,
    tcp_wait_and_state,
)
from numaserve.worker.spec import flat_spec


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            m = await receive()
            await send({"type": m["type"] + ".complete"})
            if m["type"] == "lifespan.shutdown":
                return
    path = scope["path"]
    if path == "/block":
        time.sleep(0.3)  # noqa: ASYNC251 - a handler that blocks the loop, on purpose
    elif path == "/sleep":
        await asyncio.sleep(0.2)
    body = path.encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def listening_socket() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s


@contextlib.asynccontextmanager
async def serving(settings: AdmissionSettings) -> AsyncIterator[tuple[AdmissionRuntime, socket.socket, WorkerServer]]:
    lst = listening_socket()
    spec = flat_spec(slot=0, node=0, generation=1, cpus=[0], mempolicy="local", memory_nodes=[0], fd=-1,
                      control="ipc:///nonexistent", framing=FramingConfig(enabled=False), admission=settings)
    rt = AdmissionRuntime(settings)
    server = WorkerServer(build_config(spec, CpuAdmissionMiddleware(app, rt), admission=rt))
    task = await start_serving(server, lst)
    try:
        yield rt, lst, server
    finally:
        rt.stop_sentinel()
        rt.probe.stop()
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        lst.close()


def get(port: int, path: str, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        c.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        out = b""
        while b"\r\n\r\n" not in out or len(out) < out.index(b"\r\n\r\n") + 4 + _length(out):
            chunk = c.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


def _length(raw: bytes) -> int:
    for line in raw.split(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def test_overload_response_is_one_complete_http_answer() -> None:
    raw = overload_response(2, "cpu")
    head, body = raw.split(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 2" in head and b"connection: close" in head
    assert b"\r\nx-numaserve-refusal: cpu" in head
    assert int(head.split(b"content-length: ")[1].split(b"\r\n")[0]) == len(body)
    assert b'"type":"overloaded"' in body


def test_runnable_tasks_counts_ready_tasks_not_awaiting_ones() -> None:
    async def main() -> tuple[int, int]:
        async def spin() -> None:
            for _ in range(5):
                await asyncio.sleep(0)

        waiting = [asyncio.ensure_future(asyncio.sleep(5)) for _ in range(20)]
        spinning = [asyncio.ensure_future(spin()) for _ in range(3)]
        await asyncio.sleep(0)
        new = asyncio.ensure_future(spin())
        counts = runnable_tasks()
        for t in waiting + spinning + [new]:
            t.cancel()
        await asyncio.gather(*waiting, *spinning, new, return_exceptions=True)
        return counts

    assert asyncio.run(main()) == (3, 1)


def test_the_runnable_count_is_reused_within_its_refresh_and_adds_admissions() -> None:
    counts = iter([(3, 1), (0, 0)])
    calls = []
    now = [10.0]

    def count() -> tuple[int, int]:
        calls.append(now[0])
        return next(counts)

    rc = RunnableCount(clock=lambda: now[0], count=count)
    assert rc() == (3, 1)
    rc.admitted()
    rc.admitted()
    now[0] += RUNNABLE_REFRESH_S / 2
    assert rc() == (3, 3) and len(calls) == 1        # the same burst of heads: no second walk
    now[0] += RUNNABLE_REFRESH_S
    assert rc() == (0, 0) and len(calls) == 2        # counted again; the admissions were in that count


def test_admission_feeds_the_runnable_count() -> None:
    async def main() -> None:
        rt = AdmissionRuntime(AdmissionSettings(sentinel=False))
        rt.runnable = RunnableCount(clock=lambda: 5.0, count=lambda: (1, 0))
        assert rt.runnable() == (1, 0)
        rt.admitted()
        assert rt.runnable() == (1, 1)
        rt.probe.stop()
    asyncio.run(main())


def test_admitted_requests_release_their_permit_and_are_counted() -> None:
    async def main() -> None:
        async with serving(AdmissionSettings()) as (rt, lst, _):
            port = lst.getsockname()[1]
            outs = await asyncio.gather(*(asyncio.to_thread(get, port, "/sleep") for _ in range(20)))
            assert all(o.startswith(b"HTTP/1.1 200") for o in outs)
            snap = rt.snapshot()
            assert snap["admitted"] == 20 and snap["ok"] == 20 and rt.gate.inflight == 0
            assert snap["delay_count"] == 20 and not snap["shed"]
    asyncio.run(main())


def test_the_protocol_refuses_with_503_retry_after_and_close_when_short_of_cpu() -> None:
    async def main() -> None:
        async with serving(AdmissionSettings(sentinel=False, close_when_overloaded=True)) as (rt, lst, _):
            port = lst.getsockname()[1]
            # the gate says: loop late and two requests already waiting for CPU
            rt.gate.on_lag(time.monotonic(), 0.5)
            rt.gate._overloaded = True
            rt.gate.request_cpu_s = 0.02
            rt.runnable = RunnableCount(count=lambda: (2, 0))
            out = await asyncio.to_thread(get, port, "/x")
            rt.runnable = RunnableCount()
            head = out.split(b"\r\n\r\n")[0].lower()
            assert out.startswith(b"HTTP/1.1 503") and b"retry-after:" in head and b"connection: close" in head
            snap = rt.snapshot()
            assert snap["shed"] == {"cpu": 1} and snap["unserved_by_status"] == {"503": 1} and snap["admitted"] == 0
            # while shedding (and asked to), admitted responses say Connection: close too
            rt.gate.lag.value = 0.0
            out = await asyncio.to_thread(get, port, "/y")
            assert out.startswith(b"HTTP/1.1 200") and b"connection: close" in out.split(b"\r\n\r\n")[0].lower()
    asyncio.run(main())


def test_a_request_whose_client_left_while_it_waited_is_not_run() -> None:
    async def main() -> None:
        async with serving(AdmissionSettings(sentinel=False, gone_check_after_s=0.0)) as (rt, lst, _):
            port = lst.getsockname()[1]
            blocker = asyncio.ensure_future(asyncio.to_thread(get, port, "/block"))
            await asyncio.sleep(0.1)          # the loop is inside the 300 ms blocking call now
            c = socket.create_connection(("127.0.0.1", port))
            c.sendall(b"GET /never HTTP/1.1\r\nhost: x\r\n\r\n")
            c.close()                         # ... and this client gives up before it is read
            assert (await blocker).startswith(b"HTTP/1.1 200")
            for _ in range(100):
                if rt.gate.snapshot(time.monotonic()).client_gone:
                    break
                await asyncio.sleep(0.02)
            snap = rt.snapshot()
            assert snap["client_gone"] == 1 and snap["ok"] == 1
    asyncio.run(main())


def test_tcp_wait_and_state_of_a_live_and_a_closed_peer() -> None:
    lst = listening_socket()
    c = socket.create_connection(lst.getsockname())
    s, _ = lst.accept()
    try:
        got = tcp_wait_and_state(s)
        assert got is not None and got[1] == 1
        c.close()
        time.sleep(0.05)
        assert tcp_wait_and_state(s)[1] != 1  # type: ignore[index]
        assert tcp_wait_and_state(object()) is None
    finally:
        s.close()
        lst.close()


@pytest.mark.parametrize("stall", [0.002])
def test_the_sentinel_answers_the_accept_queue_while_a_handler_blocks(stall: float) -> None:
    async def main() -> None:
        settings = AdmissionSettings(stall_after_s=stall, stall_idle_after_s=0.05, stall_queue=1)
        async with serving(settings) as (rt, lst, _server):
            rt.start_sentinel([lst], None)
            port = lst.getsockname()[1]
            outs: list[bytes] = []

            def clients() -> None:   # threads of their own: the test's loop is the server's, and it blocks
                time.sleep(0.1)
                ths = [threading.Thread(target=lambda i=i: outs.append(get(port, f"/q{i}"))) for i in range(6)]
                for th in ths:
                    th.start()
                for th in ths:
                    th.join()

            driver = threading.Thread(target=clients)
            driver.start()
            assert (await asyncio.to_thread(get, port, "/block")).startswith(b"HTTP/1.1 200")
            await asyncio.to_thread(driver.join)
            refused = [o for o in outs if o.startswith(b"HTTP/1.1 503")]
            served = [o for o in outs if o.startswith(b"HTTP/1.1 200")]
            assert refused and served and len(refused) + len(served) == 6
            assert all(b"retry-after:" in o.lower() for o in refused)
            assert all(b"\r\nx-numaserve-refusal: stalled\r\n" in o for o in refused)
            sent = rt.sentinel
            assert sent is not None and sent.shed == len(refused)
            assert rt.snapshot()["shed"]["stalled"] == len(refused)
    asyncio.run(main())


def test_a_lingering_client_that_keeps_sending_costs_a_bounded_number_of_reads_per_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sentinel reads a shed connection's leftovers with the GIL held: a client that keeps sending
    must not keep it in that loop (each pass reads at most LINGER_READS times, then moves on)."""
    from numaserve.net import heldsock
    from numaserve.worker.shedding import Sentinel

    a, b = socket.socketpair()
    try:
        b.setblocking(False)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        a.setblocking(False)
        sent = 0
        with contextlib.suppress(BlockingIOError):
            while sent < (4 << 20):
                sent += a.send(b"x" * 65536)
        calls = []
        real_recv = heldsock.recv
        monkeypatch.setattr(heldsock, "recv", lambda fd, peek=False: calls.append(fd) or real_recv(fd, peek))
        s = Sentinel.__new__(Sentinel)       # only the lingering list: no listener, no thread
        s._pending, s._linger = [], [(b.fileno(), time.monotonic() + 60.0)]
        s._service(time.monotonic())
        assert sent > Sentinel.LINGER_READS * 65536   # more queued than one pass reads
        assert len(calls) == Sentinel.LINGER_READS
        assert s._linger == [(b.fileno(), s._linger[0][1])]   # still lingering: its deadline has not come
    finally:
        a.close()
        b.close()


def test_with_nothing_in_flight_the_sentinel_sleeps_in_poll_on_the_listeners_not_blind() -> None:
    """Between two requests (nothing in flight) the sentinel used to sleep a blind 50 ms: the loop
    took the next connection, blocked in its handler, and the connections queued behind that call
    waited unseen for the rest of the sleep (2x capacity, blocking handlers: a quarter of the
    sentinel's 503s came 55 ms late).  Now it sleeps in poll() on the listeners; a queued
    connection wakes it, and while the (idle) loop has not taken it up, it naps 10, 20, 40 ms,
    at most ``IDLE_POLL_MS`` (a loop held by something that is no request wakes it rarely; a new
    connection per request must not wake it per connection)."""
    from numaserve.worker.shedding import Sentinel

    lst = listening_socket()
    rt = AdmissionRuntime(AdmissionSettings())
    sent = Sentinel(rt, [lst], None)
    polls: list[float] = []
    naps: list[float] = []
    listen_fd = next(iter(sent._listen_fds))

    class Poll:   # a connection waits in the accept queue the whole time
        def poll(self, timeout_ms: float) -> list[tuple[int, int]]:
            polls.append(timeout_ms)
            return [(listen_fd, 1)]

    class Stop:
        def is_set(self) -> bool:
            return len(naps) >= 8

        def wait(self, s: float) -> bool:
            naps.append(s)
            return False

    sent._poll, sent._stop_evt = Poll(), Stop()   # type: ignore[assignment]
    try:
        assert rt.gate.inflight == 0
        sent._run()
        assert polls and all(t == Sentinel.IDLE_POLL_MS for t in polls)
        assert naps == [0.01, 0.02, 0.04, 0.05, 0.05, 0.05, 0.05, 0.05]
    finally:
        for s in sent._listeners:
            s.close()
        lst.close()


def test_the_sentinels_nap_is_short_again_after_a_stall_it_acted_on() -> None:
    """The nap doubles while the loop keeps taking its connections itself (a new connection per
    request on a loop that never stalls), and is back at ``QUEUED_LOOK_S`` once the sentinel met a
    stall: a loop running blocking handlers is looked at 10 ms after a connection comes."""
    from numaserve.worker.shedding import Sentinel

    lst = listening_socket()
    rt = AdmissionRuntime(AdmissionSettings())
    sent = Sentinel(rt, [lst], None)
    naps: list[float] = []
    listen_fd = next(iter(sent._listen_fds))
    stalled_polls: list[float] = []

    class Poll:
        def poll(self, timeout_ms: float) -> list[tuple[int, int]]:
            if rt.gate.inflight > 0:           # the stalled branch looked, found nobody queued
                stalled_polls.append(timeout_ms)
                rt.gate.inflight = 0           # ... and the call ended
                return []
            return [(listen_fd, 1)]            # idle: a connection waits for the loop

    class Stop:
        def is_set(self) -> bool:
            return len(naps) >= 5

        def wait(self, s: float) -> bool:
            naps.append(s)
            if len(naps) == 3:                 # the loop now blocks in a handler, long past the limit
                now = time.monotonic()
                rt.gate.inflight = 1
                rt.gate.note_shed(now)         # shedding: the short stall limit applies
                rt.probe.beat = now - 10.0
            return False

    sent._poll, sent._stop_evt = Poll(), Stop()   # type: ignore[assignment]
    try:
        sent._run()
        assert stalled_polls and sent.stalls == 1
        assert naps == [0.01, 0.02, 0.04, 0.01, 0.02]
    finally:
        rt.gate.inflight = 0
        for s in sent._listeners:
            s.close()
        lst.close()
