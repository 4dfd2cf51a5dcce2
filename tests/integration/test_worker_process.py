"""The worker as a real process, with the test playing supervisor.

The test owns a SO_REUSEPORT listener and a ZeroMQ ROUTER, starts
``python -m numaserve.worker`` with the spec in the environment and the
listener fd passed, and checks the control protocol and real HTTP.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from numaserve.control.messages import (
    Ack,
    Command,
    Drain,
    Goodbye,
    Heartbeat,
    Hello,
    Ready,
    Stats,
    Stop,
    decode_from_worker,
    encode,
)
from numaserve.worker.main import EXIT_APP_LOAD_FAILED
from numaserve.worker.spec import SPEC_ENV, WorkerSpec, flat_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

SLOW_APP = textwrap.dedent('''
    import asyncio

    def make():
        async def app(scope, receive, send):
            if scope["type"] == "lifespan":
                while True:
                    m = await receive()
                    if m["type"] == "lifespan.startup":
                        await send({"type": "lifespan.startup.complete"})
                    else:
                        await send({"type": "lifespan.shutdown.complete"})
                        return
            delay = float(scope["query_string"].decode() or "0")
            more = True
            while more:
                more = (await receive()).get("more_body", False)
            await asyncio.sleep(delay)
            body = b"slept %g" % delay
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
        return app
''')

FAILING_LIFESPAN_APP = textwrap.dedent('''
    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.failed", "message": "boom: no model\\nsecond line"})
            return
''')


RAISING_LIFESPAN_APP = textwrap.dedent('''
    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            await receive()
            raise RuntimeError("weights missing: /models/x.safetensors")
''')

NO_LIFESPAN_APP = textwrap.dedent('''
    async def app(scope, receive, send):
        assert scope["type"] == "http", "no lifespan here"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
''')


class FakeSupervisor:
    """Listener + ROUTER, like the real supervisor holds them."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="nsw-")  # short path: ipc names are limited to ~107 bytes
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"ipc://{self.dir}/ctl.sock"
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(self.endpoint)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.backlog: list[tuple[bytes, Any]] = []
        self.pending: list[tuple[bytes, Any]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spec(self, **overrides: Any) -> WorkerSpec:
        base: dict[str, Any] = dict(
            slot=0, node=0, generation=1, cpus=sorted(os.sched_getaffinity(0)),
            mempolicy="local", memory_nodes=[0], fd=self.listener.fileno(),
            control=self.endpoint, heartbeat_interval=0.2, stats_interval=0.2,
            graceful_timeout=5.0,
        )
        base.update(overrides)
        return flat_spec(**base)

    def spawn(self, **overrides: Any) -> subprocess.Popen[bytes]:
        spec = self.spec(**overrides)
        env = dict(os.environ)
        env[SPEC_ENV] = spec.to_env()
        log = open(Path(self.dir) / f"worker-{len(self.procs)}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "numaserve.worker"], env=env,
                                pass_fds=[self.listener.fileno()], stdout=log, stderr=log)
        log.close()
        self.procs.append(proc)
        return proc

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(Path(self.dir).glob("*.log")))

    def recv(self, timeout: float) -> tuple[bytes, Any] | None:
        """Next message; stats riding on a beat come next, as the Stats they are."""
        if self.pending:
            return self.pending.pop(0)
        if self.router.poll(int(timeout * 1000)):
            frames = self.router.recv_multipart()
            msg = decode_from_worker(frames[-1])
            if isinstance(msg, Heartbeat) and msg.stats is not None:
                self.pending.append((frames[0], msg.stats))
            return frames[0], msg
        return None

    def expect(self, kind: type, timeout: float = 10.0, pid: int | None = None,
               where: Any = None) -> tuple[bytes, Any]:
        """Next message of ``kind`` (from ``pid`` if given); others are kept in ``backlog``."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            got = self.recv(max(0.0, left)) if left > 0 else None
            if got is None:
                raise AssertionError(f"no {kind.__name__} within {timeout}s\n--- worker logs ---\n"
                                     + self.logs()[-4000:])
            ident, msg = got
            if isinstance(msg, kind) and (pid is None or ident.endswith(f":{pid}".encode())) \
                    and (where is None or where(msg)):
                return ident, msg
            self.backlog.append(got)

    def send(self, ident: bytes, msg: Any) -> None:
        self.router.send_multipart([ident, encode(msg)])

    def start_ready(self, **overrides: Any) -> tuple[subprocess.Popen[bytes], bytes]:
        proc = self.spawn(**overrides)
        ident, hello = self.expect(Hello, pid=proc.pid)
        assert hello.pid == proc.pid
        self.expect(Ready, pid=proc.pid)
        return proc, ident

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        self.router.close(0)
        self.ctx.term()
        self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def sup() -> Any:
    s = FakeSupervisor()
    try:
        yield s
    finally:
        s.close()


def write_app(sup: FakeSupervisor, name: str, source: str) -> str:
    d = Path(sup.dir) / "apps"
    d.mkdir(exist_ok=True)
    (d / f"{name}.py").write_text(source)
    return str(d)


def raw_exchange(port: int, data: bytes, timeout: float = 5.0) -> tuple[bytes, bool]:
    """Send ``data``; return everything read until the server closes, and whether it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        closed = False
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            except ConnectionResetError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            chunks.append(chunk)
        return b"".join(chunks), closed


# --- tests -----------------------------------------------------------------------


def test_lifecycle_http_heartbeats_stats_stop_and_queued_connection_survives(sup: FakeSupervisor) -> None:
    proc = sup.spawn()
    ident, hello = sup.expect(Hello, pid=proc.pid)
    assert hello.slot == 0 and hello.generation == 1
    assert ident == f"0:1:{proc.pid}".encode()
    assert hello.placement is not None and hello.placement.cpus
    sup.expect(Ready, pid=proc.pid)

    with httpx.Client(base_url=sup.url, timeout=10) as c:
        who = c.get("/").json()
        assert who["pid"] == proc.pid
        assert c.get("/healthz").text == "ok"
        r = c.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 8})
        assert r.status_code == 200
        body = r.json()
        assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10}
        assert c.get("/nope").status_code == 404

    beats = [sup.expect(Heartbeat, pid=proc.pid)[1] for _ in range(5)]
    gaps = [b.mono - a.mono for a, b in zip(beats, beats[1:])]
    assert all(0.09 < g < 0.6 for g in gaps), gaps   # >= half an interval: a late beat's next is that soon
    assert all(b.loop_lag < 0.2 for b in beats)

    _, stats = sup.expect(Stats, pid=proc.pid, where=lambda m: m.requests >= 4)
    assert stats.status_classes.get("2xx") == 3 and stats.status_classes.get("4xx") == 1
    assert stats.inflight == 0 and stats.rss_bytes > 0
    assert stats.latency_ms["max"] > 0 and sum(stats.extra["latency_buckets"]) == 4

    sup.send(ident, Stop(id="stop-1", deadline=5))
    _, ack = sup.expect(Ack, pid=proc.pid)
    assert ack.ref == "stop-1" and ack.ok
    _, bye = sup.expect(Goodbye, pid=proc.pid)
    assert bye.reason == "stopped"
    assert proc.wait(10) == 0

    # No worker now: a client connects (the kernel completes the handshake into
    # the listener's backlog) and sends its request. A new worker on the same
    # fd must answer it.
    queued = socket.create_connection(("127.0.0.1", sup.port), timeout=10)
    queued.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    proc2, _ = sup.start_ready(generation=2)
    data = b""
    while chunk := queued.recv(65536):
        data += chunk
    queued.close()
    assert data.startswith(b"HTTP/1.1 200"), data
    assert data.endswith(b"ok")
    assert proc2.pid != proc.pid


def test_stats_ride_on_the_beats(sup: FakeSupervisor) -> None:
    """Stats due as often as beats: one message per interval (the beat carries them), none standalone."""
    proc, _ = sup.start_ready()
    raw = []
    end = time.monotonic() + 10
    while len(raw) < 6 and time.monotonic() < end:
        if sup.router.poll(1000):
            frames = sup.router.recv_multipart()
            if frames[0].endswith(f":{proc.pid}".encode()):
                raw.append(decode_from_worker(frames[-1]))
    assert len(raw) == 6 and all(isinstance(x, Heartbeat) for x in raw), [type(x).__name__ for x in raw]
    carried = [x.stats for x in raw if x.stats is not None]
    # stats ride on the beats; an idle worker's unchanged ones stay off most of them (the
    # supervisor keeps the last ones it got), so at least the first beat carries them
    assert len(carried) >= 1, "the beats should carry the stats"
    assert all(st.slot == 0 and st.generation == 1 and st.rss_bytes > 0 for st in carried)
    # ... and stats that changed ride on the next beat
    assert httpx.get(sup.url + "/", timeout=10).status_code == 200
    end = time.monotonic() + 10
    changed = None
    while changed is None and time.monotonic() < end:
        if sup.router.poll(1000):
            frames = sup.router.recv_multipart()
            if frames[0].endswith(f":{proc.pid}".encode()):
                msg = decode_from_worker(frames[-1])
                assert isinstance(msg, Heartbeat), type(msg).__name__
                if msg.stats is not None and msg.stats.requests >= 1:
                    changed = msg.stats
    assert changed is not None, "the stats after a request did not ride on a beat"


def test_sigstop_stops_heartbeats(sup: FakeSupervisor) -> None:
    proc, _ = sup.start_ready()
    sup.expect(Heartbeat, pid=proc.pid)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        time.sleep(0.05)
        while sup.recv(0.05) is not None:  # whatever was queued before the stop took effect
            pass
        silent_until = time.monotonic() + 1.0
        while time.monotonic() < silent_until:
            got = sup.recv(silent_until - time.monotonic())
            assert got is None or not isinstance(got[1], Heartbeat), "heartbeat from a stopped worker"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    # beats queued in the worker's zmq thread before the stop arrive first; the
    # beat whose sleep spanned the stop reports the stall as loop lag
    lags = [sup.expect(Heartbeat, pid=proc.pid, timeout=5)[1].loop_lag for _ in range(3)]
    assert max(lags) > 0.5, lags


def test_drain_finishes_inflight_then_exits(sup: FakeSupervisor) -> None:
    app_dir = write_app(sup, "slowapp", SLOW_APP)
    proc, ident = sup.start_ready(app="slowapp:make()", app_dir=app_dir)
    result: dict[str, Any] = {}

    def slow() -> None:
        with httpx.Client(timeout=15) as c:
            r = c.get(f"{sup.url}/?1.0")
            result["status"] = r.status_code
            result["body"] = r.text
            result["connection"] = r.headers.get("connection")

    t = threading.Thread(target=slow)
    t.start()
    sup.expect(Stats, pid=proc.pid, where=lambda m: m.inflight == 1)
    sup.send(ident, Drain(id="drain-1", deadline=10))
    _, ack = sup.expect(Ack, pid=proc.pid)
    assert ack.ref == "drain-1"
    sup.expect(Stats, pid=proc.pid, where=lambda m: m.draining)
    # while draining, a new connection stays queued in the listener: not ours any more
    late = socket.create_connection(("127.0.0.1", sup.port), timeout=10)
    late.sendall(b"GET /?0 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    _, bye = sup.expect(Goodbye, pid=proc.pid, timeout=10)
    t.join(10)
    assert result == {"status": 200, "body": "slept 1", "connection": "close"}
    assert bye.reason == "drained"
    assert proc.wait(10) == 0
    # ... and the replacement answers it
    sup.start_ready(generation=2, app="slowapp:make()", app_dir=app_dir)
    data = b""
    while chunk := late.recv(65536):
        data += chunk
    late.close()
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"slept 0"), data


@pytest.mark.parametrize("overlap", [True, False], ids=["rolling", "stop-then-start"])
def test_replacing_a_worker_under_load_loses_no_request(sup: FakeSupervisor, overlap: bool) -> None:
    """Invariant 2: clients hammering the listener see no error while the worker is replaced.

    ``rolling``: the new worker is ready before the old one drains (the reload
    path).  ``stop-then-start``: nobody serves for a while; connections wait in
    the listener's backlog until the replacement starts.
    """
    proc1, ident1 = sup.start_ready()
    stop = threading.Event()
    outcomes: list[str] = []
    lock = threading.Lock()

    def client() -> None:
        while not stop.is_set():
            try:
                data, _ = raw_exchange(sup.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
                                       b"Connection: close\r\n\r\n", timeout=10)
                ok = data.startswith(b"HTTP/1.1 200") and data.endswith(b"ok")
                res = "ok" if ok else f"bad {data[:40]!r}"
            except OSError as e:
                res = f"error {e!r}"
            with lock:
                outcomes.append(res)

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        if overlap:
            proc2, _ = sup.start_ready(generation=2)
            sup.send(ident1, Drain(id="d1", deadline=5))
            sup.expect(Goodbye, pid=proc1.pid)
        else:
            sup.send(ident1, Stop(id="s1", deadline=5))
            sup.expect(Goodbye, pid=proc1.pid)
            assert proc1.wait(10) == 0
            time.sleep(0.3)  # nobody accepts: clients pile up in the backlog
            proc2, _ = sup.start_ready(generation=2)
        time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(15)
    assert proc1.wait(10) == 0
    bad = [o for o in outcomes if o != "ok"]
    assert len(outcomes) > 20 and not bad, (len(outcomes), bad[:5])


def test_drain_closes_keepalive_connections(sup: FakeSupervisor) -> None:
    proc, ident = sup.start_ready()
    with socket.create_connection(("127.0.0.1", sup.port), timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b"\r\n\r\nok"):
            chunk = s.recv(65536)
            assert chunk, first
            first += chunk
        assert first.startswith(b"HTTP/1.1 200") and b"connection: close" not in first.lower()
        sup.send(ident, Drain(id="d", deadline=5))
        sup.expect(Ack, pid=proc.pid)
        # within the idle grace, a request on the kept-alive connection is served with close
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        second = b""
        while chunk := s.recv(65536):
            second += chunk
        assert second.startswith(b"HTTP/1.1 200") and b"connection: close" in second.lower()
    sup.expect(Goodbye, pid=proc.pid)
    assert proc.wait(10) == 0


def test_bad_app_is_a_boot_failure(sup: FakeSupervisor) -> None:
    proc = sup.spawn(app="nosuchmod:app")
    sup.expect(Hello, pid=proc.pid)
    _, bye = sup.expect(Goodbye, pid=proc.pid)
    assert bye.reason.startswith("app load failed: ModuleNotFoundError")
    assert "nosuchmod" in bye.reason and "\n" not in bye.reason
    assert proc.wait(10) == EXIT_APP_LOAD_FAILED == 3


def test_lifespan_startup_failure_is_a_boot_failure(sup: FakeSupervisor) -> None:
    app_dir = write_app(sup, "badlife", FAILING_LIFESPAN_APP)
    proc = sup.spawn(app="badlife:app", app_dir=app_dir)
    _, bye = sup.expect(Goodbye, pid=proc.pid)
    assert bye.reason == "lifespan startup failed: boom: no model"
    assert proc.wait(10) == 3



def test_lifespan_raising_after_startup_is_a_startup_failure(sup: FakeSupervisor) -> None:
    """Issue 31: a plain ASGI app that received lifespan.startup and raised is not "lifespan unsupported"."""
    app_dir = write_app(sup, "raiselife", RAISING_LIFESPAN_APP)
    proc = sup.spawn(app="raiselife:app", app_dir=app_dir)
    _, bye = sup.expect(Goodbye, pid=proc.pid)
    assert bye.reason == "lifespan startup failed: RuntimeError: weights missing: /models/x.safetensors"
    assert proc.wait(10) == 3


def test_an_app_raising_before_it_received_anything_still_means_no_lifespan(sup: FakeSupervisor) -> None:
    app_dir = write_app(sup, "nolife", NO_LIFESPAN_APP)
    proc = sup.spawn(app="nolife:app", app_dir=app_dir)
    sup.expect(Ready, pid=proc.pid)      # uvicorn's rule kept: it serves


@pytest.mark.parametrize("http", ["auto", "h11"])
def test_malformed_and_oversized_requests_are_answered_and_closed(sup: FakeSupervisor, http: str) -> None:
    proc, _ = sup.start_ready(http=http, max_header_bytes=8192, max_body_bytes=1000)
    # starts like HTTP (a method token) but is not: 400 and closed
    data, closed = raw_exchange(sup.port, b"GARBAGE\x01\x02 nonsense\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 400") and closed, data[:80]
    # a TLS ClientHello on the plain port cannot start a frame within max_frame_bytes either
    # (issue 34): an HTTP client's 400, as uvicorn answers it, never a binary error frame
    data, closed = raw_exchange(sup.port, b"\x16\x03\x01garbage\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 400") and closed, data[:120]
    # a 100 kB header block in one write (usually one read on the server)
    data, closed = raw_exchange(sup.port, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                b"X-Big: " + b"a" * 100_000 + b"\r\n\r\n")
    if http == "auto":  # our httptools guard counts complete headers too
        assert data.startswith(b"HTTP/1.1 431") and closed, data[:80]
    else:  # h11 only limits *incomplete* events: one read may carry more; it answers either way
        assert data.startswith(b"HTTP/1.1 "), data[:80]
    # the same trickling in: both protocols refuse once the limit is passed
    with socket.create_connection(("127.0.0.1", sup.port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
        reply = b""
        try:
            for _ in range(40):
                s.sendall(b"a" * 1000)
                time.sleep(0.01)
            reply = s.recv(65536)
        except (BrokenPipeError, ConnectionResetError):
            pass
        if not reply:
            with contextlib.suppress(OSError):
                reply = s.recv(65536)
    assert reply.startswith(b"HTTP/1.1 431" if http == "auto" else b"HTTP/1.1 400"), reply[:80]
    data, closed = raw_exchange(sup.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                b"Content-Length: 5000\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 413") and closed
    data, closed = raw_exchange(sup.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                b"Transfer-Encoding: chunked\r\n\r\n" + b"3e8\r\n" + b"x" * 1000
                                + b"\r\n" + b"3e8\r\n" + b"x" * 1000 + b"\r\n0\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 413") and closed
    with httpx.Client(timeout=5) as c:  # still serving
        assert c.get(f"{sup.url}/healthz").status_code == 200
    assert proc.poll() is None


def test_slow_body_and_slow_headers_get_408(sup: FakeSupervisor) -> None:
    sup.start_ready(read_timeout=0.5)
    data, closed = raw_exchange(sup.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                b"Content-Length: 100\r\n\r\n{\"prompt\"")
    assert data.startswith(b"HTTP/1.1 408") and closed   # the read timeout answered, not the client's
    data, closed = raw_exchange(sup.port, b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    assert data.startswith(b"HTTP/1.1 408") and closed


def test_garbage_on_control_socket_is_dropped(sup: FakeSupervisor) -> None:
    proc, ident = sup.start_ready()
    for junk in (b"", b"\x00\x01\x02", b"\xc1" * 100, encode(Ack(slot=0, generation=1, ref="x")),
                 os.urandom(4096)):
        sup.router.send_multipart([ident, junk])
    sup.router.send_multipart([ident, b"extra", b"frames", b"\x93"])
    sup.send(ident, Command(id="p1", name="ping"))
    _, ack = sup.expect(Ack, pid=proc.pid)
    assert ack.ref == "p1" and ack.ok
    sup.send(ident, Command(id="u1", name="frobnicate"))
    _, ack = sup.expect(Ack, pid=proc.pid)
    assert not ack.ok and ack.detail == "unknown command frobnicate"
    with httpx.Client(timeout=5) as c:
        assert c.get(f"{sup.url}/healthz").status_code == 200
    _, stats = sup.expect(Stats, pid=proc.pid, where=lambda m: m.extra.get("control_bad_frames", 0) >= 6)
    assert proc.poll() is None


def test_sigterm_is_a_graceful_stop_and_sigint_is_ignored(sup: FakeSupervisor) -> None:
    proc, _ = sup.start_ready()
    os.kill(proc.pid, signal.SIGINT)
    sup.expect(Heartbeat, pid=proc.pid)
    with httpx.Client(timeout=5) as c:
        assert c.get(f"{sup.url}/healthz").status_code == 200
    assert proc.poll() is None
    os.kill(proc.pid, signal.SIGTERM)
    _, bye = sup.expect(Goodbye, pid=proc.pid)
    assert bye.reason == "stopped: SIGTERM"
    assert proc.wait(10) == 0


def test_orphaned_worker_exits(sup: FakeSupervisor) -> None:
    """The worker's parent dies without a word: the heartbeat loop notices the reparenting."""
    spec = sup.spec()
    env = dict(os.environ)
    env[SPEC_ENV] = spec.to_env()
    fd = sup.listener.fileno()
    launcher = (
        "import subprocess, sys;"
        f"p = subprocess.Popen([sys.executable, '-m', 'numaserve.worker'], pass_fds=[{fd}],"
        " stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL);"
        "print(p.pid, flush=True);"
        "sys.stdin.readline()"  # the test says when: after the worker's Hello, then this parent vanishes
    )
    parent = subprocess.Popen([sys.executable, "-c", launcher], env=env, pass_fds=[fd],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert parent.stdin is not None and parent.stdout is not None
    pid = int(parent.stdout.readline().split()[0])
    try:
        sup.expect(Hello, pid=pid, timeout=15)       # started, and knows its parent
        parent.stdin.write(b"go\n")
        parent.stdin.close()
        assert parent.wait(20) == 0
        _, bye = sup.expect(Goodbye, pid=pid, timeout=15)
        assert bye.reason == "supervisor gone"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(5)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
