"""The load generator against a tiny in-test HTTP server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import struct
import threading
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numaserve.tools.loadtest import (
    LatencyRecorder,
    LoadConfig,
    LoadConfigError,
    arun_load,
    build_request,
    parse_duration,
    parse_header,
    parse_url,
    percentiles_of,
    resolve_target,
    run_load,
)

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------ test server


class FakeServer:
    """asyncio HTTP/1.1 server in its own thread; behaviour chosen by path.

    The responses are fixed bytes written by hand: this is the *server* side.
    ``stall_at=N`` blocks the whole server loop for ``stall_s`` when request N
    arrives (like a GC pause); ``idle_close`` closes keep-alive connections
    idle that long.
    """

    def __init__(self, *, stall_at: int | None = None, stall_s: float = 0.2, idle_close: float | None = None,
                 close_listener_after: float | None = None) -> None:
        self.stall_at, self.stall_s, self.idle_close = stall_at, stall_s, idle_close
        self.close_listener_after = close_listener_after
        self.count = 0
        self.connections = 0
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        assert self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(5)

    def url(self, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=512)
        self.port = server.sockets[0].getsockname()[1]
        if self.close_listener_after is not None:
            self._loop.call_later(self.close_listener_after, server.close)
        self._ready.set()
        await self._stop.wait()
        server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.idle_close)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
                        asyncio.TimeoutError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.count += 1
                if self.count == self.stall_at:
                    time.sleep(self.stall_s)  # blocks this server's loop: every client waits
                close = headers.get("connection", "").lower() == "close"
                if not await self._respond(method, path, body, close, writer):
                    return
                if close:
                    return
        finally:
            writer.close()

    async def _respond(self, method: str, path: str, body: bytes, close: bool,
                       writer: asyncio.StreamWriter) -> bool:
        conn = b"Connection: close\r\n" if close else b""
        if path == "/slow":
            await asyncio.sleep(1.0)
        if path == "/close":
            return False
        if path == "/reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return False
        if path == "/garbage":
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            await writer.drain()
            return False
        if path == "/chunked":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n" + conn +
                         b"\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
        elif path == "/eof":
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
            await writer.drain()
            return False
        elif path == "/conn-close":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
            await writer.drain()
            return False
        elif path == "/404":
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n" + conn + b"\r\nnot found")
        elif path == "/echo":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n" % len(body) + conn + b"\r\n" + body)
        elif method == "HEAD":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n" + conn + b"\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Type: text/plain\r\n" + conn +
                         b"\r\nhello")
        await writer.drain()
        return True


@pytest.fixture
def server() -> Any:
    with FakeServer() as s:
        yield s


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ------------------------------------------------------------- histogram


def test_recorder_exact_below_precision_range() -> None:
    r = LatencyRecorder(precision_bits=8)
    for us in (0, 1, 50, 255):
        r.record(us / 1e6)
    assert [(lo, hi, c) for lo, hi, c in r.buckets()] == [(0, 0, 1), (1, 1, 1), (50, 50, 1), (255, 255, 1)]
    assert r.min_us == 0 and r.max_us == 255


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=2**40), st.integers(min_value=2, max_value=12))
def test_recorder_bucket_contains_value_and_is_narrow(v: int, k: int) -> None:
    r = LatencyRecorder(precision_bits=k)
    lo, hi = r.bounds(r._index(v))
    assert lo <= v <= hi
    if v >= 2**k:
        assert (hi - lo + 1) / lo <= 2 ** (1 - k)


def test_percentiles_on_known_inputs() -> None:
    values_ms = list(range(1, 1001))                    # 1..1000 ms, shuffled order must not matter
    values_ms = values_ms[::2] + values_ms[1::2]
    s = percentiles_of(v / 1000 for v in values_ms)
    for name, exact in (("p50", 500), ("p75", 750), ("p90", 900), ("p99", 990), ("p99.9", 999)):
        assert exact <= s[name] <= exact * 1.008, (name, s[name])   # highest-equivalent value, < 0.8 % over
    assert s["min"] == 1.0 and s["max"] == 1000.0
    assert s["mean"] == pytest.approx(500.5, abs=0.01)
    assert s["stdev"] == pytest.approx(math.sqrt((1000**2 - 1) / 12), rel=1e-3)


def test_percentiles_single_value_and_empty() -> None:
    assert percentiles_of([0.0123])["p50"] == pytest.approx(12.3, rel=0.008)
    assert percentiles_of([0.0123])["max"] == 12.3
    empty = LatencyRecorder().summary_ms()
    assert empty["p99"] == 0.0 and empty["max"] == 0.0


def test_recorder_merge_and_coarse() -> None:
    a, b = LatencyRecorder(), LatencyRecorder()
    for i in range(100):
        a.record(0.001 * (i + 1))
        b.record(0.5)
    a.merge(b)
    assert a.count == 200 and a.max_us == 500_000 and a.min_us == 1000
    assert a.percentile_us(0.5) <= 100_800 and a.percentile_us(0.51) >= 499_000
    from numaserve.worker.stats import BUCKET_UPPER_MS

    coarse = a.coarse(BUCKET_UPPER_MS)
    assert sum(coarse) == 200
    with pytest.raises(ValueError):
        a.merge(LatencyRecorder(precision_bits=6))


# ----------------------------------------------------------------- config


def test_parse_duration() -> None:
    assert parse_duration("10s") == 10.0
    assert parse_duration("500ms") == 0.5
    assert parse_duration("2m") == 120.0
    assert parse_duration("1.5") == 1.5
    assert parse_duration("1h") == 3600.0
    for bad in ("", "ten", "5x", "-1s"):
        with pytest.raises(LoadConfigError):
            parse_duration(bad)


def test_parse_header_and_url() -> None:
    assert parse_header("Content-Type: application/json") == ("Content-Type", "application/json")
    for bad in ("NoColon", ": v", "Bad Name: v", "Content-Length: 3"):
        with pytest.raises(LoadConfigError):
            parse_header(bad)
    t = parse_url("http://[::1]:8080/v1/models?x=1")
    assert (t.host, t.port, t.path, t.host_header) == ("::1", 8080, "/v1/models?x=1", "[::1]:8080")
    assert parse_url("http://localhost").path == "/" and parse_url("http://localhost").port == 80
    for bad in ("https://127.0.0.1/", "127.0.0.1:80", "http://:80/", "http://u:p@127.0.0.1/",
                "http://127.0.0.1:99999/"):
        with pytest.raises(LoadConfigError):
            parse_url(bad)


@pytest.mark.parametrize("kw, msg", [
    (dict(rate=10, concurrency=2), "not both"),
    (dict(rate=0), "--rate"),
    (dict(concurrency=0), "--concurrency"),
    (dict(concurrency=2, connections=4), "--connections"),
    (dict(duration=0), "--duration"),
    (dict(requests=0), "--requests"),
    (dict(timeout=-1), "--timeout"),
    (dict(arrivals="bursty", rate=5), "--arrivals"),
    (dict(method="get me"), "method"),
    (dict(headers=(("X", "a\r\nInjected: 1"),)), "line break"),
])
def test_config_validation(kw: dict[str, Any], msg: str) -> None:
    with pytest.raises(LoadConfigError, match=msg) as ei:
        LoadConfig("http://127.0.0.1:1/", **kw).validate()
    assert isinstance(ei.value, ValueError) and ei.value.exit_code == 2


def test_only_local_targets_unless_allowed() -> None:
    assert resolve_target(parse_url("http://127.0.0.1:9/"))
    assert resolve_target(parse_url("http://localhost:9/"))
    remote = parse_url("http://192.0.2.1:80/")          # TEST-NET-1: never an address of this host
    with pytest.raises(LoadConfigError, match="--allow-remote"):
        resolve_target(remote)
    assert resolve_target(remote, allow_remote=True) == [(socket.AF_INET, ("192.0.2.1", 80))]
    with pytest.raises(LoadConfigError, match="--allow-remote"):
        run_load(LoadConfig("http://192.0.2.1:80/", duration=0.1))


def test_build_request() -> None:
    cfg = LoadConfig("http://127.0.0.1:8/p?q=1", method="POST", body=b'{"a":1}', keepalive=False,
                     headers=(("Content-Type", "application/json"), ("User-Agent", "me")))
    raw = build_request(cfg, parse_url(cfg.url))
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /p?q=1 HTTP/1.1"
    assert "Host: 127.0.0.1:8" in lines and "Content-Length: 7" in lines and "Connection: close" in lines
    assert "User-Agent: me" in lines and not any(ln.startswith("User-Agent: numaserve") for ln in lines)
    assert body == b'{"a":1}'
    get = build_request(LoadConfig("http://h/"), parse_url("http://h/"))
    assert b"Content-Length" not in get and b"Connection" not in get


# ------------------------------------------------------------------ engine


def test_closed_loop_exact_request_count_keepalive(server: FakeServer) -> None:
    r = run_load(LoadConfig(server.url(), concurrency=4, requests=200, duration=10))
    assert r.duration_s < 10                        # ended on the count, not on the duration bound
    assert r.requests == 200 and server.count == 200 and r.status_counts == {200: 200}
    assert r.ok and r.error_count == 0 and r.mode == "closed"
    assert r.connects == 4 + 1                      # one per client + the preflight check
    assert r.bytes_read > 200 * 5 and r.bytes_written > 200 * 20
    assert 0 < r.latency["p50"] <= r.latency["p99"] <= r.latency["max"] < 1000


def test_closed_loop_duration_bound_and_no_keepalive(server: FakeServer) -> None:
    r = run_load(LoadConfig(server.url(), concurrency=3, duration=0.5, keepalive=False))
    assert r.duration_s >= 0.5                      # ran for its duration, did not stop early
    assert r.requests > 10 and r.ok
    assert r.connects == r.requests + 1 and server.connections == r.connects


def test_open_loop_uniform_count(server: FakeServer) -> None:
    r = run_load(LoadConfig(server.url(), rate=200, duration=1.0, arrivals="uniform"))
    assert r.requests == 200 and server.count == 200 and r.ok
    assert r.rate == pytest.approx(200, rel=0.1)
    assert r.send_lag_hist.count == 200
    assert r.peak_connections <= 128


def test_open_loop_request_cap_and_poisson(server: FakeServer) -> None:
    r = run_load(LoadConfig(server.url(), rate=500, requests=50, duration=10, seed=7))
    assert r.requests == 50 and server.count == 50
    assert r.duration_s < 10                       # ended after the 50th arrival, not on the 10 s duration


def test_open_loop_measures_from_scheduled_time() -> None:
    """A single 200 ms server stall: the open loop sees it in p99 (every request
    scheduled during the stall waited); a closed loop hides it in one sample."""
    with FakeServer(stall_at=100) as s:
        open_r = run_load(LoadConfig(s.url(), rate=200, duration=2.0, arrivals="uniform"))
    with FakeServer(stall_at=100) as s:
        closed_r = run_load(LoadConfig(s.url(), concurrency=1, duration=1.5))
    assert open_r.ok and closed_r.ok
    assert open_r.requests == 400
    assert open_r.latency["max"] >= 190
    assert open_r.latency["p99"] >= 100, open_r.latency
    # ~40 of 400 requests were scheduled during the stall, waiting 200..0 ms: the top 5 % waited >= ~100 ms
    assert open_r.latency_hist.percentile_us(0.95) >= 50_000, open_r.latency
    assert closed_r.latency["max"] >= 190
    assert closed_r.latency["p99"] < open_r.latency["p99"] / 2, (closed_r.latency, open_r.latency)


def test_timeouts_counted_and_run_bounded(server: FakeServer) -> None:
    r = run_load(LoadConfig(server.url("/slow"), concurrency=2, duration=0.5, timeout=0.2))
    # bounded: each client gives up after 0.2 s and starts none after 0.5 s (at most 3 each)
    assert r.requests == 0 and 4 <= r.errors["timeout"] <= 6 and not r.ok
    assert "0.2s" in r.error_samples["timeout"]
    # open loop: the deadline runs from the scheduled time
    r = run_load(LoadConfig(server.url("/slow"), rate=20, duration=0.5, timeout=0.3, arrivals="uniform"))
    assert r.requests == 0 and r.errors["timeout"] == 10
    assert r.latency_hist.count == 0


def test_open_loop_pool_bound(server: FakeServer) -> None:
    r = run_load(LoadConfig(server.url("/slow"), rate=50, duration=0.4, timeout=0.5, connections=4,
                            arrivals="uniform"))
    assert r.peak_connections == 4                     # never more in use at once, though 20 were due
    assert r.requests == 0 and r.errors["timeout"] == 20
    assert r.connects == server.connections            # a timed-out connection is closed, not reused
    d = r.to_dict()
    assert d["pool_timeouts"] == r.pool_timeouts and d["backlog_drops"] == 0


def test_open_loop_backlog_is_bounded(server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    import numaserve.tools.loadtest as lt

    monkeypatch.setattr(lt, "MAX_BACKLOG", 5)
    r = run_load(LoadConfig(server.url("/slow"), rate=100, duration=0.2, timeout=0.3, connections=2,
                            arrivals="uniform"))
    assert r.backlog_drops == 15 and r.errors["timeout"] == 20 and r.requests == 0


def test_late_answer_is_a_timeout_not_a_response(server: FakeServer) -> None:
    r = run_load(LoadConfig(server.url("/slow"), concurrency=1, requests=1, timeout=0.9))
    assert r.requests == 0 and r.errors["timeout"] == 1


def test_refused_target_aborts_at_once_with_connect_error() -> None:
    r = run_load(LoadConfig(f"http://127.0.0.1:{closed_port()}/", concurrency=4, duration=5))
    # one refused preflight, then no client ever started: aborted, not run out its 5 s
    assert r.errors["connect"] == 1 and r.requests == 0 and not r.ok and r.duration_s < 5
    assert "refused" in (r.aborted or "").lower()


def test_connect_errors_counted_mid_run() -> None:
    with FakeServer(close_listener_after=0.4) as s:
        r = run_load(LoadConfig(s.url(), rate=100, duration=1.0, arrivals="uniform", keepalive=False))
    assert r.requests == pytest.approx(40, abs=8)
    assert r.errors["connect"] == pytest.approx(60, abs=8)
    # a connection caught in the listen backlog when the listener closes is reset instead
    assert r.requests + r.error_count == 100, (r.errors, r.error_samples)


@pytest.mark.parametrize("path, kind", [("/reset", "reset"), ("/garbage", "read"), ("/close", "read")])
def test_error_kinds(server: FakeServer, path: str, kind: str) -> None:
    r = run_load(LoadConfig(server.url(path), concurrency=1, requests=5, duration=5))
    assert r.errors[kind] == 5, (r.errors, r.error_samples)
    assert r.error_count == 5 and r.requests == 0


def test_response_framings(server: FakeServer) -> None:
    for path, keep in (("/chunked", True), ("/eof", False), ("/conn-close", False), ("/404", True)):
        r = run_load(LoadConfig(server.url(path), concurrency=2, requests=20, duration=5))
        assert r.requests == 20 and r.error_count == 0, (path, r.errors, r.error_samples)
        assert (r.connects == 3) is keep, (path, r.connects)
    assert r.status_counts == {404: 20} and r.non_2xx == 20


def test_head_and_post_body(server: FakeServer) -> None:
    r = run_load(LoadConfig(server.url(), method="HEAD", concurrency=1, requests=10, duration=5))
    assert r.requests == 10 and r.error_count == 0 and r.connects == 2
    body = json.dumps({"max_tokens": 4}).encode()
    r = run_load(LoadConfig(server.url("/echo"), method="POST", body=body, concurrency=2, requests=10, duration=5))
    assert r.requests == 10 and r.ok
    assert r.bytes_read >= 10 * len(body)


def test_idle_keepalive_closed_by_server_is_not_an_error() -> None:
    with FakeServer(idle_close=0.05) as s:
        r = run_load(LoadConfig(s.url(), rate=10, duration=1.0, arrivals="uniform", connections=2))
    assert r.requests == 10 and r.error_count == 0, (r.errors, r.error_samples)


def test_stop_event_ends_run_early(server: FakeServer) -> None:
    async def main() -> Any:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.3, stop.set)
        return await arun_load(LoadConfig(server.url(), concurrency=2, duration=30), stop=stop)

    r = asyncio.run(main())
    assert r.interrupted and r.duration_s < 30 and r.requests > 0 and r.aborted is None


def test_run_load_refuses_running_loop(server: FakeServer) -> None:
    async def main() -> None:
        run_load(LoadConfig(server.url(), requests=1))

    with pytest.raises(RuntimeError, match="arun_load"):
        asyncio.run(main())


def test_result_dict_is_json(server: FakeServer) -> None:
    r = run_load(LoadConfig(server.url(), rate=100, duration=0.3))
    d = json.loads(json.dumps(r.to_dict()))
    assert d["mode"] == "open" and d["requests"] == r.requests and d["ok"] is True
    assert set(d["latency_ms"]) == {"min", "p50", "p75", "p90", "p99", "p99.9", "max", "mean", "stdev"}
    assert set(d["errors"]) == {"connect", "read", "timeout", "reset"}
    assert sum(c for _, c in d["histogram"]["buckets"]) == r.requests
    assert d["send_lag_ms"]["max"] >= 0 and d["client_cpu_s"] >= 0


# --------------------------------------------------------------------- CLI


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from numaserve import cli

    cli.COMMANDS.setdefault("loadtest", "numaserve.cli.loadtest_cmd:loadtest")
    with pytest.raises(SystemExit) as ei:
        cli.main(argv)
    out, err = capsys.readouterr()
    return int(ei.value.code or 0), out, err


@pytest.mark.parametrize("argv", [
    ["loadtest"],
    ["loadtest", "http://127.0.0.1:1/", "--rate", "abc"],
    ["loadtest", "http://127.0.0.1:1/", "--rate", "5", "--concurrency", "2"],
    ["loadtest", "http://127.0.0.1:1/", "--duration", "soon"],
    ["loadtest", "http://127.0.0.1:1/", "--nope"],
    ["loadtest", "ftp://127.0.0.1/"],
    ["loadtest", "http://192.0.2.1/"],
    ["loadtest", "http://127.0.0.1:1/", "-b", "x", "--body-file", "/dev/null"],
    ["loadtest", "http://127.0.0.1:1/", "--body-file", "/nonexistent/body"],
])
def test_cli_bad_arguments_exit_2_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(argv, capsys)
    assert code == 2 and out == ""
    assert err.startswith("numaserve: error: ") and err.count("\n") == 1, err


def test_cli_refused_target_summary_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["loadtest", f"http://127.0.0.1:{closed_port()}/", "-d", "2s", "--no-json"], capsys)
    assert code == 1
    assert "connect 1" in out and "refused" in out.lower() and "Requests/sec" in out


def test_cli_text_and_json(server: FakeServer, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(["loadtest", server.url(), "-c", "2", "-n", "50", "--no-json", "--histogram"], capsys)
    assert code == 0, out
    for needle in ("Running", "2 connections, closed loop", "Latency Distribution", "99.9%", "50 requests in",
                   "Socket errors: none", "Requests/sec:", "Transfer/sec:", "Latency Histogram"):
        assert needle in out, (needle, out)
    code, out, _ = _cli(["loadtest", server.url("/404"), "-r", "100", "-d", "300ms", "--json"], capsys)
    d = json.loads(out)
    assert code == 0 and d["non_2xx"] == d["requests"] > 0 and d["mode"] == "open"
