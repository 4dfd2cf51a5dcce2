"""The real `numaserve start`, real workers, real HTTP on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.integration.harness import (
    FAST_CONFIG,
    REPO,
    Running,
    http_get,
    numaserve_argv,
    pid_alive,
    two_pretend_nodes,
)

pytestmark = pytest.mark.slow


def test_two_workers_on_node0_serve_and_report(tmp_path: Path) -> None:
    with Running(["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0"]) as sup:
        st = sup.status()
        slots = st["slots"]
        assert [s["slot"] for s in slots] == [0, 1]
        required = {"slot", "node", "pid", "generation", "state", "cpus", "mempolicy", "binding_verified",
                    "rss_bytes", "uptime_s", "restarts", "last_restart_reason", "requests", "inflight"}
        for s in slots:
            assert required <= set(s), required - set(s)
            assert s["node"] == 0 and s["state"] == "ready" and s["generation"] == 1
            assert s["mempolicy"] == "bind"
        # the two workers split node 0's CPUs (2 CPUs here: one each) and are verified from outside
        st = sup.wait_for(lambda st: all(s["binding_verified"] is True for s in st["slots"]), 15, "binding verified")
        # one node here: every resident page is on the bound node
        assert all(s["remote_memory_share"] == 0.0 for s in st["slots"]), [s["remote_memory_share"] for s in st["slots"]]
        cpus = [tuple(s["cpus"]) for s in sup.slots()]
        assert set(cpus[0]).isdisjoint(cpus[1]) or len(os.sched_getaffinity(0)) == 1
        seen = set()
        for _ in range(60):
            status, body = http_get(sup.port, "/")
            assert status == 200
            seen.add(json.loads(body)["slot"])
            if seen == {0, 1}:
                break
        assert seen == {0, 1}, "connections should reach both slots' listeners"
        sup.wait_for(lambda st: sum(s["requests"] for s in st["slots"]) >= 2, 10, "stats counted")


def test_declared_two_pretend_nodes_bind_each_worker(tmp_path: Path) -> None:
    declared, cpus = two_pretend_nodes(tmp_path)
    with Running(["--nodes", "all", "--declared", str(declared), "--bind", "127.0.0.1:0"]) as sup:
        st = sup.wait_for(lambda st: all(s["binding_verified"] is True for s in st["slots"]), 15, "verified")
        by_node = {s["node"]: s for s in st["slots"]}
        assert set(by_node) == {0, 1}
        assert by_node[0]["cpus"] == [cpus[0]] and by_node[1]["cpus"] == [cpus[1]]
        assert by_node[1]["memory_nodes"] == [0]
        for s in st["slots"]:
            # every thread of the worker is on its pretend node's CPU
            for task in Path(f"/proc/{s['pid']}/task").iterdir():
                line = [x for x in (task / "status").read_text().splitlines() if x.startswith("Cpus_allowed_list")]
                assert line[0].split()[1] == str(s["cpus"][0])
        seen = {}
        for _ in range(60):
            status, body = http_get(sup.port, "/")
            d = json.loads(body)
            seen[d["node"]] = d
            if len(seen) == 2:
                break
        assert set(seen) == {0, 1}


def _connect_and_send(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        socks.append(s)
    return socks


def _read_all(s: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            b = s.recv(65536)
        except OSError as e:
            return b"ERROR " + str(e).encode()
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def test_kill9_worker_queued_connections_are_served_by_replacement() -> None:
    with Running(["--nodes", "0", "--workers-per-node", "1", "--bind", "127.0.0.1:0"]) as sup:
        old = sup.slots()[0]
        os.kill(old["pid"], signal.SIGSTOP)          # it stops accepting: connections queue up
        socks = _connect_and_send(sup.port, 20)
        st = sup.status()
        assert sum(st["supervisor"]["accept_queue"]["0"]) >= 1
        os.kill(old["pid"], signal.SIGKILL)
        replies = [_read_all(s) for s in socks]
        for s in socks:
            s.close()
        ok = [r for r in replies if r.startswith(b"HTTP/1.1 200")]
        assert len(ok) == 20, [r[:60] for r in replies if not r.startswith(b"HTTP/1.1 200")]
        bodies = [json.loads(r.split(b"\r\n\r\n", 1)[1]) for r in ok]
        assert {b["pid"] for b in bodies} != {old["pid"]}
        assert all(b["generation"] == 2 for b in bodies)
        s = sup.wait_for(lambda st: st["slots"][0]["state"] == "ready", 20, "replacement ready")["slots"][0]
        assert s["restarts"] == 1 and "SIGKILL" in (s["last_restart_reason"] or "")


def test_stopped_worker_is_found_hung_and_replaced() -> None:
    with Running(["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0"]) as sup:
        victim = sup.slots()[1]
        os.kill(victim["pid"], signal.SIGSTOP)
        st = sup.wait_for(
            lambda st: st["slots"][1]["generation"] == 2 and st["slots"][1]["state"] == "ready", 30, "hung replaced"
        )
        s = st["slots"][1]
        assert "hung" in s["last_restart_reason"], s
        assert s["pid"] != victim["pid"]
        assert not pid_alive(victim["pid"])
        assert st["slots"][0]["generation"] == 1        # the other slot was untouched
        assert http_get(sup.port)[0] == 200


def test_bad_app_is_a_clear_one_line_error() -> None:
    sup = Running(["--nodes", "0", "--app", "nosuchmod_xyz:app", "--bind", "127.0.0.1:0"], expect_ready=False)
    try:
        rc = sup.wait_exit(60)
        err = sup.stderr_path.read_text()
    finally:
        sup.close()
    assert rc == 3, err
    last = [line for line in err.splitlines() if line.startswith("numaserve: error:")]
    assert last and "nosuchmod_xyz" in last[-1] and "no slot could start" in last[-1], err[-2000:]
    # the worker's log keeps the import traceback inside one JSON event (useful when
    # the error is deep in the app); nothing is dumped raw onto the terminal
    assert not any(line.startswith("Traceback") for line in err.splitlines())


def test_bad_cli_input_exits_2_without_traceback(tmp_path: Path) -> None:
    cases = [
        ["start", "--nodes", "7"],
        ["start", "--nodes", "x-y"],
        ["start", "--workers-per-node", "0"],
        ["start", "--bind", "nonsense"],
        ["start", "--app", "a:b", "--cmd", "x"],
        ["start", "--cmd", "server --port {nope}"],
    ]
    for args in cases:
        r = subprocess.run(numaserve_argv(*args, "--runtime-dir", str(tmp_path / "rt")), capture_output=True,
                           text=True, timeout=60, cwd=str(REPO))
        assert r.returncode == 2, (args, r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("numaserve: error:"), (args, r.stderr)


def test_no_worker_outlives_a_killed_supervisor_and_stale_files_do_not_block() -> None:
    sup = Running(["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0"])
    try:
        pids = [s["pid"] for s in sup.slots()]
        sup.proc.kill()
        sup.proc.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.05)
        assert not any(pid_alive(p) for p in pids)
        assert (sup.rt / "ops.sock").exists()    # stale files left behind by the killed supervisor
        # a new supervisor on the same runtime dir starts fine
        second = subprocess.Popen(
            numaserve_argv("start", "--config", str(sup.config), "--runtime-dir", str(sup.rt), "--nodes", "0",
                           "--bind", "127.0.0.1:0"),
            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=str(REPO),
        )
        try:
            deadline = time.monotonic() + 30
            ready = False
            while time.monotonic() < deadline and second.poll() is None:
                r = sup.ops("status", "--json")
                if r.returncode == 0 and all(s["state"] == "ready" for s in json.loads(r.stdout)["slots"]):
                    ready = True
                    break
                time.sleep(0.2)
            assert ready, second.stderr.read().decode() if second.poll() is not None else "not ready"
            # and a third on the same directory is refused while the second lives
            r = subprocess.run(
                numaserve_argv("start", "--runtime-dir", str(sup.rt), "--bind", "127.0.0.1:0"),
                capture_output=True, text=True, timeout=30, cwd=str(REPO),
            )
            assert r.returncode == 2 and "another supervisor" in r.stderr, r.stderr
        finally:
            second.terminate()
            second.wait(30)
    finally:
        sup.close()


def test_graceful_stop_finishes_inflight_then_exits_0() -> None:
    with Running(["--nodes", "0", "--app", "slowapp:app", "--bind", "127.0.0.1:0"]) as sup:
        result: dict[str, object] = {}

        def slow() -> None:
            result["r"] = http_get(sup.port, "/sleep?s=1.5", timeout=20)

        t = threading.Thread(target=slow)
        t.start()
        sup.wait_for(lambda st: st["slots"][0]["inflight"] >= 1, 10, "request in flight")
        sup.signal(signal.SIGTERM)
        t.join(20)
        assert result["r"][0] == 200
        assert sup.wait_exit(30) == 0
        events = [e.get("event") for e in sup.events()]
        assert "graceful_stop" in events and "stopped" in events


def test_second_signal_stops_fast() -> None:
    with Running(["--nodes", "0", "--app", "slowapp:app", "--bind", "127.0.0.1:0"]) as sup:
        t = threading.Thread(target=lambda: _swallow(lambda: http_get(sup.port, "/sleep?s=20", timeout=30)))
        t.start()
        sup.wait_for(lambda st: st["slots"][0]["inflight"] >= 1, 10, "request in flight")
        t0 = time.monotonic()
        sup.signal(signal.SIGTERM)
        time.sleep(0.5)
        sup.signal(signal.SIGINT)
        rc = sup.wait_exit(15)
        assert rc == 4 and time.monotonic() - t0 < 10
        t.join(30)


def _swallow(fn):  # type: ignore[no-untyped-def]
    try:
        fn()
    except Exception:
        pass


def test_stop_command_and_status_without_supervisor(tmp_path: Path) -> None:
    with Running(["--nodes", "0", "--bind", "127.0.0.1:0"]) as sup:
        r = sup.ops("stop")
        assert r.returncode == 0, r.stderr
        assert sup.wait_exit(30) == 0
        r = sup.ops("status")
        assert r.returncode == 1 and "no supervisor is running" in r.stderr and "Traceback" not in r.stderr


def test_crash_loop_marks_one_slot_failed_while_others_serve() -> None:
    cfg = FAST_CONFIG.replace("[supervisor]", "[supervisor]\ncrash_loop_limit = 3\ncrash_loop_window = 60.0")
    with Running(["--nodes", "0", "--workers-per-node", "2", "--app", "crashy:app", "--bind", "127.0.0.1:0"],
                 config=cfg, env={"CRASHY_SLOT": "1"}, expect_ready=False) as sup:
        st = sup.wait_for(lambda st: st["slots"] and st["slots"][1]["state"] == "failed", 40, "slot 1 failed")
        assert st["slots"][0]["state"] == "ready"
        assert "exit 7" in (st["slots"][1]["failed_reason"] or "")
        for _ in range(10):
            status, body = http_get(sup.port or int(st["supervisor"]["listeners"][0].rsplit(":", 1)[1]))
            assert status == 200 and body == b"slot 0"


def test_external_cmd_is_bound_supervised_and_serves() -> None:
    cmd = "{python} -m uvicorn numaserve.apps.demo:app --fd {fd} --log-level warning".replace(
        "{python}", __import__("sys").executable
    )
    with Running(["--nodes", "0", "--workers-per-node", "2", "--cmd", cmd, "--bind", "127.0.0.1:0"]) as sup:
        st = sup.wait_for(lambda st: all(s["binding_verified"] is True for s in st["slots"]), 20, "verified")
        assert all(s["external"] for s in st["slots"])
        assert http_get(sup.port)[0] == 200
        victim = st["slots"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        sup.wait_for(lambda st: st["slots"][0]["generation"] == 2 and st["slots"][0]["state"] == "ready", 20,
                     "external worker restarted")
