"""Ops requests on the real supervisor: concurrent, deadline-aware, rate-limited per verified user (issue 34, 1-2).

Findings pinned here: one ``cache purge`` waiting for a frozen worker's
acknowledgement held ``status`` and ``stop`` for the whole wait; ``stop``s
whose clients had given up ran 30 s later; one member of the read-only
group with 16 connections got 16 rate budgets.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from numaserve.control import messages as m
from tests.integration.harness import FAST_CONFIG, Running

pytestmark = pytest.mark.slow

ONE = ["--nodes", "0", "--bind", "127.0.0.1:0"]
# a frozen worker stays "hung", not killed, for the whole test
PATIENT = FAST_CONFIG.replace("heartbeat_timeout = 3.0", "heartbeat_timeout = 600.0")


def _request(path: Path, req: m.OpsRequest, timeout: float = 30.0) -> m.OpsReply:
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
        s.connect(f"ipc://{path}")
        s.send(msgspec.msgpack.encode(req))
        return m.decode_ops_reply(s.recv())
    finally:
        ctx.destroy(0)


def test_a_frozen_workers_ack_wait_holds_up_no_other_ops_request() -> None:
    with Running(ONE, config=PATIENT) as sup:
        pid = sup.slots()[0]["pid"]
        os.kill(pid, signal.SIGSTOP)
        ctx = zmq.Context()
        try:
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(f"ipc://{sup.rt / 'ops.sock'}")
            enc = msgspec.msgpack.encode
            d.send_multipart([b"", enc(m.OpsRequest(verb="cache_purge", id="purge", args={"timeout": 60.0}))])
            d.send_multipart([b"", enc(m.OpsRequest(verb="ping", id="ping"))])
            # one connection is read in order: once the ping is answered the purge is in the supervisor's hands
            assert d.poll(30_000), "ping not answered while a purge waits for a frozen worker"
            first = m.decode_ops_reply(d.recv_multipart()[-1])
            assert first.id == "ping" and first.ok, first
            for cmd in (["status", "--json"], ["undrain"], ["cache", "version"]):
                r = sup.ops(*cmd, "--timeout", "20")
                assert r.returncode == 0, (cmd, r.stderr)
            assert not d.poll(0), "the purge cannot have been acknowledged by a stopped worker"
            r = sup.ops("stop", "--timeout", "20")
            assert r.returncode == 0, r.stderr
            assert sup.wait_exit(60) in (0, 4)   # 4: stopped, the frozen worker had to be killed
        finally:
            with contextlib.suppress(ProcessLookupError):   # stop may have killed it already
                os.kill(pid, signal.SIGCONT)
            ctx.destroy(0)


def test_a_request_read_after_its_clients_deadline_is_not_executed() -> None:
    with Running(ONE) as sup:
        stale = m.OpsRequest(verb="stop", id="stale", timeout=5.0, sent_at=time.time() - 60.0)
        reply = _request(sup.rt / "ops.sock", stale)
        assert not reply.ok and "not executed" in reply.error and "timeout" in reply.error, reply
        assert sup.proc.poll() is None and sup.status()["slots"][0]["state"] == "ready"
        fresh = m.OpsRequest(verb="ping", id="fresh", timeout=5.0, sent_at=time.time())
        assert _request(sup.rt / "ops.sock", fresh).ok


def _flood_as_nobody(path: Path, connections: int, each: int) -> dict[str, Any]:
    """In a child as uid/gid 65534 (group nogroup): ``each`` status requests on each of ``connections``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        out: dict[str, Any] = {"ok": 0, "limited": 0, "other": []}
        try:
            os.close(r)
            os.setgroups([65534])
            os.setgid(65534)
            os.setuid(65534)
            ctx = zmq.Context()
            socks = []
            for _ in range(connections):
                s = ctx.socket(zmq.REQ)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.RCVTIMEO, 60_000)
                s.connect(f"ipc://{path}")
                socks.append(s)
            payload = msgspec.msgpack.encode(m.OpsRequest(verb="status", id="flood"))
            for _ in range(each):
                for s in socks:
                    s.send(payload)
                for s in socks:
                    rep = m.decode_ops_reply(s.recv())
                    if rep.ok:
                        out["ok"] += 1
                    elif "rate limited" in rep.error:
                        out["limited"] += 1
                    else:
                        out["other"].append(rep.error)
            ctx.destroy(0)
        except Exception as e:
            out["other"].append(f"{type(e).__name__}: {e}")
        finally:
            os.write(w, json.dumps(out).encode())
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def test_the_read_only_rate_limit_is_per_user_not_per_connection() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user in the read-only group")
    cfg = FAST_CONFIG + '\n[ops]\nreadonly_group = "nogroup"\nrate_limit = 1.0\nrate_burst = 5\n'
    with Running(ONE, config=cfg) as sup:
        # 16 connections x 5 requests: within every connection's own burst, far past one user's
        got = _flood_as_nobody(sup.rt / "ops-ro.sock", connections=16, each=5)
        assert got["other"] == [], got
        assert got["limited"] >= 40 and got["ok"] + got["limited"] == 80, got
        # root (the owner's socket) is still served
        assert sup.status()["slots"][0]["state"] == "ready"
        assert sup.status()["supervisor"]["control_plane"]["ops_rate_limited"] >= 40
