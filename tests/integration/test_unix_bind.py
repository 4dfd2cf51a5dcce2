"""`--bind unix:PATH` through the real `numaserve start` (issue 35): served by every worker from one
supervisor-held socket with the configured mode, a stale socket file replaced and a live one refused
(exit 2), queued connections kept across a worker's death, `--cmd ... --fd {fd}` on it, and the file
removed at stop."""

from __future__ import annotations

import os
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import FAST_CONFIG, Running

pytestmark = pytest.mark.slow


@pytest.fixture
def sock_path() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="ns-uds-"))
    yield d / "ns.sock"
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def client(path: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://numaserve", timeout=60)


def test_serves_over_a_unix_socket_with_its_mode_and_removes_it_at_stop(sock_path: Path) -> None:
    cfg = FAST_CONFIG.replace("[server]\n", '[server]\nunix_mode = "0640"\n')
    sup = Running(["--nodes", "0", "--workers-per-node", "2", "--bind", f"unix:{sock_path}"], config=cfg)
    try:
        st = sup.status()
        assert st["supervisor"]["listeners"] == [f"unix:{sock_path}"]
        assert stat.S_ISSOCK(os.lstat(sock_path).st_mode) and stat.S_IMODE(os.lstat(sock_path).st_mode) == 0o640
        pids = {s["pid"] for s in st["slots"]}
        seen = set()
        with client(sock_path) as c:
            for _ in range(200):
                r = c.get("/", headers={"connection": "close"})
                assert r.status_code == 200
                seen.add(r.json()["pid"])
                if seen == pids:
                    break
        assert seen <= pids and seen, (seen, pids)
        sup.signal(signal.SIGTERM)
        assert sup.wait_exit(60) == 0
        assert not sock_path.exists()
    finally:
        sup.close()


def test_a_stale_socket_file_is_replaced_and_a_live_one_refused(sock_path: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_path))
    stale.close()                     # the file stays, nobody listens: a killed server's leftover
    with Running(["--nodes", "0", "--bind", f"unix:{sock_path}"]) as sup:
        with client(sock_path) as c:
            assert c.get("/healthz").text == "ok"
        # a second supervisor on the same path while the first serves: refused, nothing touched
        second = Running(["--nodes", "0", "--bind", f"unix:{sock_path}"], expect_ready=False)
        try:
            assert second.wait_exit(60) == 2
            err = second.stderr_path.read_text()
            assert f"server.bind unix:{sock_path}: another server listens on it" in err, err
            assert len(err.strip().splitlines()) == 1, err
        finally:
            second.close()
        with client(sock_path) as c:
            assert c.get("/healthz").text == "ok"   # the first one's socket file was left alone


def test_connections_queued_on_a_dead_worker_are_served_by_its_replacement(sock_path: Path) -> None:
    with Running(["--nodes", "0", "--workers-per-node", "1", "--bind", f"unix:{sock_path}"]) as sup:
        pid = sup.slots()[0]["pid"]
        os.kill(pid, signal.SIGSTOP)      # accepts nothing: what arrives now waits in the socket's queue
        results: list[object] = []

        def one() -> None:
            try:
                with client(sock_path) as c:
                    results.append(c.get("/").json()["pid"])
            except Exception as e:  # noqa: BLE001 - recorded, asserted below
                results.append(e)

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        time.sleep(1.0)                   # let them connect (either way they wait for the replacement)
        os.kill(pid, signal.SIGKILL)
        for t in threads:
            t.join(90)
        assert len(results) == 8 and all(isinstance(r, int) and r != pid for r in results), results


def test_cmd_uvicorn_serves_the_unix_socket_through_fd(sock_path: Path) -> None:
    cmd = f"{sys.executable} -m uvicorn scopeapp:app --fd {{fd}} --log-level warning"
    with Running(["--nodes", "0", "--workers-per-node", "2", "--cmd", cmd, "--bind", f"unix:{sock_path}"]) as sup:
        pids = {s["pid"] for s in sup.slots()}
        with client(sock_path) as c:
            r = c.get("/x")
        assert r.status_code == 200 and r.json()["pid"] in pids and r.json()["path"] == "/x"


def test_a_rolling_restart_under_load_on_the_unix_socket_fails_no_request(sock_path: Path) -> None:
    with Running(["--nodes", "0", "--workers-per-node", "2", "--bind", f"unix:{sock_path}"]) as sup:
        before = {s["pid"] for s in sup.slots()}
        stop = threading.Event()
        ok: list[int] = []
        failures: list[str] = []

        def load(fresh: bool) -> None:
            with client(sock_path) as c:
                while not stop.is_set():
                    try:
                        r = c.get("/", headers={"connection": "close"} if fresh else {})
                        if r.status_code == 200:
                            ok.append(r.json()["pid"])
                        else:
                            failures.append(f"status {r.status_code}")
                    except Exception as e:  # noqa: BLE001 - recorded, asserted below
                        failures.append(repr(e))

        threads = [threading.Thread(target=load, args=(fresh,)) for fresh in (False, False, True, True)]
        for t in threads:
            t.start()
        try:
            r = sup.ops("restart", "--node", "0", "--wait", timeout=120)
            assert r.returncode == 0, r.stderr
        finally:
            time.sleep(0.5)
            stop.set()
            for t in threads:
                t.join(60)
        after = {s["pid"] for s in sup.slots()}
        assert not failures, failures[:10]
        assert not (after & before) and set(ok) & before and set(ok) & after, (before, after, set(ok))


def test_the_socket_file_of_a_killed_supervisor_is_replaced(sock_path: Path) -> None:
    with Running(["--nodes", "0", "--workers-per-node", "2", "--bind", f"unix:{sock_path}"]) as first:
        pids = [s["pid"] for s in first.slots()]
        first.proc.kill()                 # SIGKILL: no clean-up, the file stays
        first.proc.wait(30)
        deadline = time.monotonic() + 60
        while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)               # the workers follow their supervisor (parent-death signal)
        assert stat.S_ISSOCK(os.lstat(sock_path).st_mode)
    with Running(["--nodes", "0", "--bind", f"unix:{sock_path}"]) as second:
        with client(sock_path) as c:
            assert c.get("/").json()["pid"] == second.slots()[0]["pid"]
