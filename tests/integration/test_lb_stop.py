"""Stopping is load-balancer safe (ARCHITECTURE invariant 13), on one real supervisor.

SIGTERM turns /readyz 503 at once; while something watches /readyz the
workers keep serving for server.lb_grace; then what is queued in the
listeners is served (never reset), then in-flight requests finish.  A second
signal skips all that.  Draining every slot is "not ready" too.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time

import pytest

from tests.integration.harness import FAST_CONFIG, Running, http_get
from tests.integration.lbfleet import _merge_server

pytestmark = pytest.mark.slow

ONE = ["--nodes", "0", "--bind", "127.0.0.1:0"]


def config(lb_grace: float) -> str:
    return _merge_server(FAST_CONFIG, f"lb_grace = {lb_grace}")


def admin_get(sup: Running, path: str) -> tuple[int, dict]:
    host, port = sup.status()["supervisor"]["admin"].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def admin_addr(sup: Running) -> tuple[str, int]:
    host, port = sup.status()["supervisor"]["admin"].rsplit(":", 1)
    return host, int(port)


def readyz_direct(addr: tuple[str, int]) -> tuple[int | None, dict]:
    """/readyz without going through the ops socket (which may be gone while stopping)."""
    try:
        conn = http.client.HTTPConnection(*addr, timeout=3)
        conn.request("GET", "/readyz")
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    except OSError:
        return None, {}


def stop_events(sup: Running) -> list[dict]:
    return [e for e in sup.events() if e.get("event") in ("lb_grace", "fast_stop", "accept_queue_not_empty",
                                                          "listeners_closed_with_queued_connections")]


def test_sigterm_turns_readyz_off_and_keeps_serving_through_lb_grace() -> None:
    with Running(ONE, config=config(3.0)) as sup:
        addr = admin_addr(sup)
        assert readyz_direct(addr)[0] == 200          # a balancer is watching
        pid = sup.slots()[0]["pid"]
        sup.signal(signal.SIGTERM)
        t0 = time.monotonic()
        status, body = readyz_direct(addr)
        assert (status, body.get("reason")) == (503, "stopping"), body
        st = sup.status()
        assert st["supervisor"]["stop_phase"] == "lb_grace" and st["supervisor"]["lb_grace_left_s"] > 0, st["supervisor"]
        # still serving new connections, from the same worker, during the grace
        served = 0
        while time.monotonic() - t0 < 1.5:
            code, body_ = http_get(sup.port)
            assert code == 200
            assert json.loads(body_)["pid"] == pid
            served += 1
        assert served > 0
        assert sup.wait_exit(30) == 0
        ev = stop_events(sup)
        assert ev and ev[0]["event"] == "lb_grace" and ev[0]["seconds"] == 3.0, ev
        assert "waiting for balancers" in ev[0]["reason"]


def test_stop_nobody_watches_skips_the_grace() -> None:
    with Running(ONE, config=config(30.0)) as sup:
        sup.signal(signal.SIGTERM)
        assert sup.wait_exit(20) == 0                 # far less than lb_grace
        ev = stop_events(sup)
        assert ev and ev[0]["event"] == "lb_grace" and ev[0]["seconds"] == 0, ev
        assert "never requested" in ev[0]["reason"]


def test_second_signal_skips_the_grace_and_stops_fast() -> None:
    with Running(ONE, config=config(60.0)) as sup:
        addr = admin_addr(sup)
        assert readyz_direct(addr)[0] == 200
        sup.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while sup.status()["supervisor"]["stop_phase"] != "lb_grace":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        sup.signal(signal.SIGINT)
        assert sup.wait_exit(20) == 4                 # EXIT_FORCED: workers were killed
        assert [e["event"] for e in stop_events(sup)] == ["lb_grace", "fast_stop"]


@pytest.mark.parametrize("sentinel", [False, True], ids=["sentinel-off", "default"])
def test_stop_serves_connections_queued_behind_a_blocked_worker(sentinel: bool) -> None:
    """The worker is stuck in a handler that blocks its loop while clients
    connect: their connections wait in the listener.  SIGTERM then must not
    reset them: they are accepted and answered before the worker stops.

    With admission's sentinel on (the default) a queue behind a loop blocked
    for over ``stall_idle_after_s`` is answered 503 + Retry-After by the
    sentinel thread instead (docs/admission.md): still an answer, never a
    reset.  With it off every queued request is served."""
    cfg = config(0) + ("" if sentinel else "\n[admission]\nsentinel = false\n")
    with Running(["--nodes", "0", "--app", "slowapp:app", "--bind", "127.0.0.1:0"], config=cfg) as sup:
        port = sup.port
        blocked: dict[str, int] = {}

        def block() -> None:
            blocked["status"] = http_get(port, "/block?s=2.5", timeout=30)[0]

        t = threading.Thread(target=block)
        t.start()
        time.sleep(0.5)
        queued = []
        for _ in range(8):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(b"GET /sleep?s=0 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            queued.append(s)
        depth = sum(sum(d or 0 for d in v) for v in sup.status()["supervisor"]["accept_queue"].values())
        assert depth >= 1, "the scenario needs connections waiting in the accept queue"
        sup.signal(signal.SIGTERM)
        answers = []
        for s in queued:
            data = b""
            try:
                while chunk := s.recv(65536):
                    data += chunk
            except OSError as e:  # ECONNRESET: the failure this test is about
                data = f"{type(e).__name__}: {e}".encode()
            s.close()
            answers.append(data.split(b"\r\n", 1)[0])
        t.join(30)
        if sentinel:
            assert all(a in (b"HTTP/1.1 200 OK", b"HTTP/1.1 503 Service Unavailable") for a in answers), (depth, answers)
        else:
            assert answers == [b"HTTP/1.1 200 OK"] * 8, (depth, answers)
        assert blocked.get("status") == 200
        assert sup.wait_exit(30) == 0
        assert not [e for e in stop_events(sup) if e["event"] == "listeners_closed_with_queued_connections"]


def test_drain_of_every_slot_makes_readyz_503() -> None:
    with Running(["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0"], config=FAST_CONFIG) as sup:
        assert admin_get(sup, "/readyz")[0] == 200
        r = sup.ops("drain", "--node", "0", "--wait")
        assert r.returncode == 0, r.stderr
        status, body = admin_get(sup, "/readyz")
        assert status == 503 and body["unready"][0]["reason"] == "no slot is serving", body
        r = sup.ops("undrain", "--node", "0", "--wait")
        assert r.returncode == 0, r.stderr
        assert admin_get(sup, "/readyz")[0] == 200
