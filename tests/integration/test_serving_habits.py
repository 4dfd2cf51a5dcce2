"""The flags uvicorn and gunicorn users reach for, through the real `numaserve start` (issue 35):
the app as a plain argument, --log-level after the subcommand, an access log with the duration,
--root-path, --proxy-headers/--forwarded-allow-ips, --timeout-keep-alive, and --max-requests /
--max-lifetime recycling workers make-before-break under load with no failed request."""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import time
from collections.abc import Iterator

import pytest

from tests.integration.harness import FAST_CONFIG, Running
from tests.integration.load import LoadLoop

pytestmark = pytest.mark.slow

# keep-alive in the file is long, so only the flag can make the server close an idle connection soon
HABITS_CONFIG = FAST_CONFIG.replace("keepalive_timeout = 2.0", "keepalive_timeout = 120.0\nmax_body_bytes = 1024")
ACCESS_FORMAT = '%(h)s "%(r)s" %(s)s %(b)s %(D)sus %({x-req}i)s'


@pytest.fixture(scope="module")
def habits() -> Iterator[Running]:
    args = ["scopeapp:app", "--nodes", "0", "--workers-per-node", "1", "--bind", "127.0.0.1:0",
            "--log-level", "info", "--access-log", "--access-log-format", ACCESS_FORMAT,
            "--root-path", "/api", "--proxy-headers", "--forwarded-allow-ips", "127.0.0.1, 10.9.0.0/16",
            "--timeout-keep-alive", "0.5"]
    with Running(args, config=HABITS_CONFIG) as sup:
        yield sup


def _get(port: int, path: str, headers: dict[str, str] | None = None) -> dict[str, object]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        assert resp.status == 200
        return json.loads(resp.read())
    finally:
        conn.close()


def _access_lines(sup: Running, pattern: str, timeout: float = 30.0) -> list[re.Match[str]]:
    deadline = time.monotonic() + timeout
    while True:
        found = [m for e in sup.events() if e.get("logger") == "numaserve.access"
                 and (m := re.fullmatch(pattern, str(e.get("event"))))]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_app_argument_serves_it_and_root_path_reaches_the_app(habits: Running) -> None:
    assert habits.port is not None
    got = _get(habits.port, "/items?x=1")
    assert got["root_path"] == "/api" and got["path"] == "/api/items", got


def test_access_log_line_carries_the_format_and_the_duration(habits: Running) -> None:
    assert habits.port is not None
    _get(habits.port, "/sleep?ms=300", {"x-req": "abc123"})
    lines = _access_lines(habits, r'(\S+) "GET /api/sleep\?ms=300 HTTP/1.1" 200 (\d+) (\d+)us abc123')
    assert lines, habits.log_tail()
    assert int(lines[0].group(2)) > 0
    assert int(lines[0].group(3)) >= 250_000      # the app slept 300 ms: the duration includes it


def test_answers_of_the_edge_are_in_the_access_log_too(habits: Running) -> None:
    assert habits.port is not None
    conn = http.client.HTTPConnection("127.0.0.1", habits.port, timeout=30)
    try:
        conn.request("POST", "/big", body=b"x" * 4096)
        assert conn.getresponse().status == 413      # over server.max_body_bytes: numaserve answers, not the app
    finally:
        conn.close()
    assert _access_lines(habits, r'\S+ "POST /api/big HTTP/1.1" 413 \d+ \d+us -'), habits.log_tail()


def test_proxy_headers_from_an_allowed_peer_set_the_client(habits: Running) -> None:
    assert habits.port is not None
    got = _get(habits.port, "/who", {"x-forwarded-for": "203.0.113.7", "x-forwarded-proto": "https"})
    assert got["client"][0] == "203.0.113.7" and got["scheme"] == "https", got
    lines = _access_lines(habits, r'203\.0\.113\.7 "GET /api/who HTTP/1.1" 200 .*')
    assert lines, habits.log_tail()


def test_timeout_keep_alive_closes_an_idle_connection(habits: Running) -> None:
    assert habits.port is not None
    s = socket.create_connection(("127.0.0.1", habits.port), timeout=30)
    try:
        s.sendall(b"GET /ka HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data or not data.endswith(b"}"):
            chunk = s.recv(4096)
            assert chunk, data
            data += chunk
        assert data.startswith(b"HTTP/1.1 200")
        # idle now: the server (keep-alive 0.5 s by flag, 120 s in the file) must close it, well within 30 s
        assert s.recv(4096) == b""
    finally:
        s.close()


def _recycled(st: dict[str, object], kind: str, n: int) -> bool:
    ops = [o for o in st["operations"] if o["kind"] == kind and o["state"] == "succeeded"]  # type: ignore[index, union-attr]
    return len(ops) >= n


def test_max_requests_recycles_workers_under_load_without_a_failed_request() -> None:
    args = ["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0",
            "--max-requests", "150", "--max-requests-jitter", "30"]
    with Running(args) as sup:
        assert sup.port is not None
        before = {s["slot"]: s["generation"] for s in sup.slots()}
        with LoadLoop(sup.port, path="/healthz", keepalive=2, fresh=2, max_seconds=120, max_requests=20000) as load:
            st = sup.wait_for(lambda st: _recycled(st, "max_requests", 2), 120, "two max_requests recycles")
        res = load.stop()
        assert not res.failures, res.failures[:10]
        ops = [o for o in st["operations"] if o["kind"] == "max_requests"]
        # none failed; the load keeps going while two succeed, so a third may still be running
        assert all(o["state"] in ("succeeded", "running") for o in ops), ops
        assert all("max_requests:" in o["args"]["reason"] for o in ops), ops
        after = {s["slot"]: s["generation"] for s in st["slots"]}
        assert any(after[k] > before[k] for k in before), (before, after)
        assert all(s["restarts"] == 0 for s in st["slots"])   # recycles, not crashes
        assert st["slots"][0]["totals"]["restarts_by_reason"].get("max_requests", 0) \
            + st["slots"][1]["totals"]["restarts_by_reason"].get("max_requests", 0) >= 2


def test_max_lifetime_recycles_a_worker() -> None:
    args = ["--nodes", "0", "--workers-per-node", "1", "--bind", "127.0.0.1:0", "--max-lifetime", "3"]
    with Running(args) as sup:
        gen = sup.slots()[0]["generation"]
        st = sup.wait_for(lambda st: _recycled(st, "max_lifetime", 1), 90, "a max_lifetime recycle")
        assert st["slots"][0]["generation"] > gen or st["slots"][0]["incoming"] is not None
        assert sup.status()["slots"][0]["state"] == "ready"


@pytest.mark.parametrize("level", ["warning", "info"])
def test_json_logs_are_json_on_every_line_and_say_where_they_serve(level: str) -> None:
    # the file turns the access log on, the flag off; proxy headers trusted from another network only
    cfg = FAST_CONFIG.replace("[server]\n", "[server]\naccess_log = true\n")
    sup = Running(["scopeapp:app", "--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0",
                   "--log-level", level, "--no-access-log", "--proxy-headers", "--forwarded-allow-ips", "10.9.0.0/16"],
                  config=cfg)
    try:
        port = sup.port
        assert port is not None
        got = _get(port, "/who", {"x-forwarded-for": "203.0.113.7"})
        assert got["client"][0] == "127.0.0.1", got      # 127.0.0.1 is not a trusted proxy here
        sup.signal(signal.SIGTERM)
        assert sup.wait_exit(60) == 0
        lines = [ln for ln in sup.stderr_path.read_text().splitlines() if ln.strip()]
        for ln in lines:
            json.loads(ln)          # no bare warning text between the records
        events = [json.loads(ln) for ln in lines]
        serving = [e for e in events if str(e.get("event", "")).startswith("serving on ")]
        assert not [e for e in events if e.get("logger") == "numaserve.access"]   # --no-access-log wins
        if level == "info":
            assert [e["event"] for e in serving] == [f"serving on http://127.0.0.1:{port}"], serving
            ready = next(i for i, e in enumerate(events) if e.get("event") == "ready")
            assert events.index(serving[0]) > ready      # once every slot is ready, not before
        else:
            assert all(e["level"] in ("warning", "error", "critical") for e in events), events
    finally:
        sup.close()
