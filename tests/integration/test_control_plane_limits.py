"""Control-plane resource bounds, on the real supervisor with real sockets.

At `ulimit -n 256` the supervisor used to die of EMFILE (libzmq aborts on an
ipc accept at the limit) after 900 idle admin connections or 300 TCP
connections to the ops endpoint; one subscription frame grew it by its size
times ~100; a flood of ops requests stalled the supervision loop for 15 s.
Each test here is one of those, and asserts the outcome an operator needs.
"""

from __future__ import annotations

import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.integration.harness import FAST_CONFIG, REPO, Running, free_port, numaserve_argv, pid_alive

pytestmark = pytest.mark.slow

TWO = ["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0"]


def _raise_own_nofile(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < n:
        pytest.skip(f"the test needs {n} open files, hard limit is {hard}")
    if soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def healthz(address: str, timeout: float = 5.0) -> tuple[int, dict[str, Any], float]:
    host, port = address.rsplit(":", 1)
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", "/healthz")
        r = conn.getresponse()
        return r.status, json.loads(r.read()), time.monotonic() - t0
    finally:
        conn.close()


def kill_and_wait_respawn(sup: Running, slot: int = 0, timeout: float = 30.0) -> float:
    """SIGKILL a slot's worker; seconds until status shows a new, ready worker there."""
    old = next(s for s in sup.slots() if s["slot"] == slot)["pid"]
    t0 = time.monotonic()
    os.kill(old, signal.SIGKILL)
    sup.wait_for(lambda st: any(s["slot"] == slot and s["pid"] not in (None, old) and s["state"] == "ready"
                                for s in st["slots"]), timeout, f"slot {slot} respawned")
    return time.monotonic() - t0


def test_idle_admin_connections_at_256_fds_leave_ops_and_respawn_working() -> None:
    _raise_own_nofile(1200)
    with Running(TWO, nofile=256) as sup:
        st = sup.status()
        admin = st["supervisor"]["admin"]
        pid = sup.proc.pid
        host, port = admin.rsplit(":", 1)
        held: list[socket.socket] = []
        try:
            for _ in range(1000):  # connect and say nothing, as the attack did
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex((host, int(port)))
                held.append(s)
            time.sleep(2.0)
            assert sup.proc.poll() is None, sup.log_tail()
            assert open_fds(pid) < 256
            # the operator's commands still work, and a crash is still repaired
            assert sup.ops("status", "--json").returncode == 0
            kill_and_wait_respawn(sup, 0)
            # and a prober still gets an answer: idle connections make room for it
            code, body, _ = healthz(admin)
            assert code == 200, body
            cp = sup.status()["supervisor"]["control_plane"]
            adm = cp["admin_connections"]
            assert adm["open"] <= adm["max_connections"] <= 64
            assert adm["evicted_idle"] + adm["refused"] > 0, adm
            assert cp["fds"]["limit"] == 256 and cp["fds"]["exhausted"] == 0, cp["fds"]
        finally:
            for s in held:
                s.close()
        assert sup.proc.poll() is None


def _keygen(directory: Path, name: str) -> tuple[Path, Path]:
    r = subprocess.run(numaserve_argv("ops", "keygen", str(directory), "--name", name), capture_output=True,
                       text=True, timeout=60, cwd=str(REPO))
    assert r.returncode == 0, r.stderr
    return directory / f"{name}.key", directory / f"{name}.key_secret"


def curve_setup(tmp_path: Path, *clients: str) -> tuple[str, int, Path, dict[str, Path], Path]:
    server_pub, server_sec = _keygen(tmp_path / "server", "server")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    secrets = {}
    for name in clients:
        pub, sec = _keygen(tmp_path / name, name)
        (authorized / f"{name}.key").write_text(pub.read_text())
        secrets[name] = sec
    port = free_port()
    cfg = FAST_CONFIG + (f'\n[ops]\ntcp_endpoint = "tcp://127.0.0.1:{port}"\ncurve_secret_key = "{server_sec}"\n'
                         f'curve_authorized_keys = "{authorized}"\n')
    return cfg, port, server_pub, secrets, authorized


def remote(port: int, server_pub: Path, secret: Path, *args: str, timeout: str = "5") -> subprocess.CompletedProcess[str]:
    return subprocess.run(numaserve_argv(*args, "--endpoint", f"tcp://127.0.0.1:{port}", "--curve-server-key",
                                         str(server_pub), "--curve-key", str(secret), "--timeout", timeout),
                          capture_output=True, text=True, timeout=60, cwd=str(REPO))


def test_unauthenticated_tcp_connections_at_256_fds_leave_the_supervisor_serving(tmp_path: Path) -> None:
    _raise_own_nofile(600)
    cfg, port, server_pub, secrets, _ = curve_setup(tmp_path, "client")
    with Running(TWO, config=cfg, nofile=256) as sup:
        pid = sup.proc.pid
        held: list[socket.socket] = []
        try:
            for _ in range(300):  # no greeting, no key: just hold the connection
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", port))
                held.append(s)
            time.sleep(2.0)
            assert sup.proc.poll() is None, sup.log_tail()
            assert open_fds(pid) < 256
            assert sup.ops("status", "--json").returncode == 0
            kill_and_wait_respawn(sup, 1)
            # an authorized operator still gets in: quiet connections make room
            r = remote(port, server_pub, secrets["client"], "status", "--json")
            assert r.returncode == 0, r.stderr
            door = sup.status()["supervisor"]["control_plane"]["front_doors"]["ops-tcp"]
            assert door["connections"] <= door["max_connections"] <= 16
            assert door["accepted"] > door["max_connections"], door   # it was full, and made room
        finally:
            for s in held:
                s.close()
        assert sup.proc.poll() is None


def test_a_huge_subscription_frame_does_not_grow_the_supervisor(tmp_path: Path) -> None:
    with Running(TWO) as sup:
        pid = sup.proc.pid
        time.sleep(1.0)
        before = rss_mb(pid)
        # the subscriber is another process, as an attacker would be (and libzmq 4.3.5 may
        # crash the *sender* when it closes a socket whose peer dropped a huge message)
        attack = (
            "import sys, time, zmq\n"
            "ctx = zmq.Context()\n"
            "big = ctx.socket(zmq.XSUB); big.connect(sys.argv[1])\n"
            "big.send(b'\\x01' + b's' * 20_000_000)\n"          # one 20 MB subscription frame
            "many = ctx.socket(zmq.XSUB); many.connect(sys.argv[1])\n"
            "for i in range(2000):\n"                              # and many small distinct ones
            "    many.send(b'\\x01' + f'topic-{i}-'.encode() + b'x' * 200)\n"
            "time.sleep(3)\n"
            "import os; os._exit(0)\n"
        )
        subprocess.run([os.sys.executable, "-c", attack, f"ipc://{sup.rt / 'events.sock'}"], timeout=60)
        time.sleep(1.0)
        grew = rss_mb(pid) - before
        assert sup.proc.poll() is None, sup.log_tail()
        assert grew < 50, f"supervisor RSS grew {grew:.0f} MB"
        # the stream itself still works for a normal subscriber
        ctx = zmq.Context()
        try:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"stats")
            sub.setsockopt(zmq.RCVTIMEO, 10000)
            sub.connect(f"ipc://{sup.rt / 'events.sock'}")
            topic, payload = sub.recv_multipart()
            assert topic == b"stats" and json.loads(payload)["slots"]
            sub.close()
        finally:
            ctx.term()
        print(f"RSS growth after a 20 MB subscription frame + 2000 subscriptions: {grew:.1f} MB")


def test_an_ops_flood_does_not_stall_the_supervision_loop() -> None:
    with Running(TWO) as sup:
        admin = sup.status()["supervisor"]["admin"]
        ctx = zmq.Context()
        dealers = []
        try:
            import msgspec

            payload = msgspec.msgpack.encode({"verb": "status", "args": {}, "id": "flood"})
            for _ in range(4):
                d = ctx.socket(zmq.DEALER)
                d.setsockopt(zmq.LINGER, 0)
                d.setsockopt(zmq.SNDHWM, 0)
                d.setsockopt(zmq.RCVHWM, 0)
                d.connect(f"ipc://{sup.rt / 'ops.sock'}")
                dealers.append(d)
            for d in dealers:
                for _ in range(7500):   # 30 000 status requests queued, nobody waiting for replies
                    d.send_multipart([b"", payload])
            ages, latencies = [], []
            t_flood = time.monotonic()
            victim = next(s for s in sup.slots() if s["slot"] == 0)["pid"]  # may be rate limited: retry inside
            os.kill(victim, signal.SIGKILL)
            t_kill = time.monotonic()
            noticed = None
            while time.monotonic() - t_flood < 15:
                code, body, took = healthz(admin)
                assert code == 200, body
                ages.append(body["loop_heartbeat_age_s"])
                latencies.append(took)
                if noticed is None and not pid_alive(victim):
                    st = sup.status()   # a fresh client process: its own rate budget
                    s0 = next(s for s in st["slots"] if s["slot"] == 0)
                    if s0["pid"] != victim:
                        noticed = time.monotonic() - t_kill
                if noticed is not None and len(ages) > 20:
                    break
                time.sleep(0.05)
            replies = 0
            limited = 0
            for d in dealers:
                while d.poll(0):
                    frames = d.recv_multipart()
                    replies += 1
                    limited += b"rate limited" in frames[-1]
        finally:
            for d in dealers:
                d.close(0)
            ctx.term()
        print(f"/healthz during a 30k-request ops flood: max latency {max(latencies):.3f}s, "
              f"max loop heartbeat age {max(ages):.3f}s; killed worker replaced after {noticed}s; "
              f"{replies} replies read, {limited} rate limited")
        assert noticed is not None, "the killed worker was not replaced during the flood"
        # outcome: the supervision loop kept ticking (it stalled 15 s before); 1 s is the
        # target, 2 s leaves room for a shared machine
        assert max(ages) < 2.0, ages
        assert sup.status()["supervisor"]["control_plane"]["ops_rate_limited"] > 0
