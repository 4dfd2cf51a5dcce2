"""Who may say what on the control plane, and what bad input gets back (real supervisor, real sockets).

Findings pinned here: a peer on control.sock could take over a slot with a
Hello naming the worker's pid (and SIGTERM the real worker with
``Hello(protocol=99)``); NaN/inf were accepted; a deleted CURVE key kept
working after reload; worker fd exhaustion was silent; a non-owner got an
"internal error"; a failed audit write was invisible and the audited
``who`` was whatever the client claimed.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from numaserve.control import messages as m
from tests.integration.harness import EXEC_WORKERS, FAST_CONFIG, REPO, Running, numaserve_argv, pid_alive
from tests.integration.test_control_plane_limits import curve_setup, remote

pytestmark = pytest.mark.slow

ONE = ["--nodes", "0", "--bind", "127.0.0.1:0"]


def dealer(ctx: zmq.Context, path: Path, identity: bytes) -> zmq.Socket:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.IDENTITY, identity)
    d.connect(f"ipc://{path}")
    return d


def test_forged_hello_stats_and_heartbeat_change_nothing_and_kill_nothing() -> None:
    with Running(ONE) as sup:
        before = sup.status()
        s0 = before["slots"][0]
        pid, gen = s0["pid"], s0["generation"]
        bad0 = before["supervisor"]["bad_messages"]
        ctx = zmq.Context()
        try:
            # the worker's own routing id is taken (the ROUTER drops a second connection with it),
            # so a forger speaks from another identity, naming the worker's slot, generation and pid
            forger = dealer(ctx, sup.rt / "control.sock", f"0:{gen}:{pid}:forged".encode())
            time.sleep(0.3)
            forged = [
                m.Hello(slot=0, generation=gen, pid=pid),                          # no token
                m.Hello(slot=0, generation=gen, pid=pid, token="0" * 32),          # wrong token
                m.Hello(protocol=99, slot=0, generation=gen, pid=pid),             # used to SIGTERM the worker
                m.Stats(slot=0, generation=gen, requests=999_999, inflight=77),
                m.Heartbeat(slot=0, generation=gen, loop_lag=0.0, mono=1.0),
                m.Goodbye(slot=0, generation=gen, reason="forged"),
                m.Ready(slot=0, generation=gen),
            ]
            for msg in forged:
                forger.send(m.encode(msg))
            time.sleep(1.5)
            forger.close()
        finally:
            ctx.term()
        after = sup.status()
        s1 = after["slots"][0]
        assert pid_alive(pid) and s1["pid"] == pid and s1["generation"] == gen and s1["state"] == "ready"
        assert s1["requests"] != 999_999 and s1["inflight"] != 77
        assert after["supervisor"]["bad_messages"] >= bad0 + len(forged)
        assert s1["control_refused"] >= len(forged)
        # the real worker's own messages still count: its heartbeat stays fresh
        time.sleep(1.0)
        assert sup.status()["slots"][0]["last_heartbeat_s"] < 2.0
        refused = [e for e in sup.events() if e.get("event") == "control_message_refused"]
        assert refused and any("SO_PEERCRED" in e["reason"] for e in refused), refused
        assert all(e["sender"]["pid"] == os.getpid() for e in refused if e.get("sender"))


def test_random_frames_on_control_and_ops_sockets_are_counted_and_harmless() -> None:
    rnd = random.Random(15)
    with Running(ONE) as sup:
        s0 = sup.slots()[0]
        bad0 = sup.status()["supervisor"]["bad_messages"]
        ctx = zmq.Context()
        try:
            ctl = dealer(ctx, sup.rt / "control.sock", b"fuzz")
            ops = dealer(ctx, sup.rt / "ops.sock", b"fuzz-ops")
            time.sleep(0.3)
            junk = [b"", b"\xc1", b"\x91" * 5000, os.urandom(64), msgspec.msgpack.encode({"type": "Hello"}),
                    msgspec.msgpack.encode({"type": "Stats", "slot": 0, "generation": s0["generation"],
                                            "requests": -1, "inflight": float("nan")}),
                    msgspec.msgpack.encode({"type": "Heartbeat", "slot": 0, "generation": s0["generation"],
                                            "loop_lag": float("nan"), "mono": float("inf")}),
                    msgspec.msgpack.encode([1, 2, 3]), msgspec.msgpack.encode({"verb": 7})]
            junk += [os.urandom(rnd.randint(1, 300)) for _ in range(200)]
            ops.send_multipart([b"", msgspec.msgpack.encode(
                {"verb": "restart", "args": {"slot": 0, "timeout": float("nan")}})])
            for j in junk:
                ctl.send(j)
                ctl.send_multipart([j, j])            # wrong frame count
                ops.send_multipart([b"", j])
            deadline = time.monotonic() + 10
            replies = []
            while time.monotonic() < deadline and len(replies) < len(junk) + 1:
                if ops.poll(200):
                    replies.append(ops.recv_multipart()[-1])
            # ctl stays open until the supervisor has read it all: LINGER 0 would drop what is still queued
            # on our side, and an ops reply says nothing about how far the control socket has been read
            while time.monotonic() < deadline and sup.status()["supervisor"]["bad_messages"] < bad0 + 2 * len(junk):
                time.sleep(0.1)
            ctl.close()
            ops.close()
        finally:
            ctx.term()
        st = sup.status()
        assert st["slots"][0]["pid"] == s0["pid"] and pid_alive(s0["pid"])
        assert st["supervisor"]["bad_messages"] >= bad0 + 2 * len(junk)
        decoded = [m.decode_ops_reply(r) for r in replies]
        assert decoded and all(not r.ok for r in decoded)
        assert not any("internal error" in r.error for r in decoded)
        assert "'timeout'" in decoded[0].error and "finite" in decoded[0].error, decoded[0]
        assert any("malformed" in r.error for r in decoded)
        assert any("rate limited" in r.error for r in decoded)   # one client, 200 requests at once


def test_nan_and_inf_are_refused_with_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "nan.toml"
    bad.write_text("[server]\ngraceful_timeout = nan\n")
    r = subprocess.run(numaserve_argv("config", "check", str(bad)), capture_output=True, text=True, timeout=60,
                       cwd=str(REPO))
    assert r.returncode == 2 and "server.graceful_timeout = nan" in r.stderr and "finite" in r.stderr, r.stderr
    env = dict(os.environ, NUMASERVE_SERVER_GRACEFUL_TIMEOUT="inf")
    r = subprocess.run(numaserve_argv("config", "show"), capture_output=True, text=True, timeout=60,
                       cwd=str(REPO), env=env)
    assert r.returncode == 2 and "NUMASERVE_SERVER_GRACEFUL_TIMEOUT" in r.stderr and "finite" in r.stderr, r.stderr
    with Running(ONE) as sup:
        for args, name in ((["restart", "--slot", "0", "--drain-timeout", "nan"], "--drain-timeout"),
                           (["drain", "--slot", "0", "--drain-timeout", "inf"], "--drain-timeout"),
                           (["reload", "--drain-timeout", "-inf"], "--drain-timeout"),
                           (["status", "--timeout", "nan"], "--timeout"),
                           (["ratelimit", "set", "9" * 400 + "/s"], "VALUE")):
            r = sup.ops(*args)
            assert r.returncode == 2 and name in r.stderr, (args, r.stderr)
        # the ops API itself refuses them too (any client, not only ours)
        from numaserve.control.client import OpsError, ops_call

        for verb, args in (("restart", {"slot": 0, "timeout": math.nan}), ("drain", {"slot": 0, "timeout": math.inf}),
                           ("reload", {"timeout": math.nan}),
                           ("ratelimit_set", {"all": True, "rate": math.inf}),
                           ("ratelimit_set", {"all": True, "rate": math.nan})):
            with pytest.raises(OpsError, match="finite"):
                ops_call(sup.rt, verb, args)
        st = sup.status()
        assert st["slots"][0]["state"] == "ready" and not st["slots"][0]["retiring"]
        assert not [o for o in st["operations"] if o["state"] == "running"]


def test_a_revoked_curve_key_is_refused_after_reload_and_sighup(tmp_path: Path) -> None:
    cfg, port, server_pub, secrets, authorized = curve_setup(tmp_path, "alice", "bob")
    with Running(ONE, config=cfg) as sup:
        for who in ("alice", "bob"):
            assert remote(port, server_pub, secrets[who], "status").returncode == 0
        (authorized / "bob.key").unlink()
        r = remote(port, server_pub, secrets["alice"], "reload", "--wait", timeout="10")
        assert r.returncode == 0, r.stderr
        r = remote(port, server_pub, secrets["bob"], "status", timeout="2")
        assert r.returncode == 1 and "no reply" in r.stderr, r.stderr
        assert remote(port, server_pub, secrets["alice"], "status").returncode == 0
        # SIGHUP (systemctl reload) re-reads them too
        (authorized / "alice.key").unlink()
        sup.signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if remote(port, server_pub, secrets["alice"], "status", timeout="2").returncode == 1:
                break
            time.sleep(0.5)
        else:
            raise AssertionError("alice's key still works after SIGHUP")
        assert sup.status()["supervisor"]["control_plane"]["curve_keys"] == 0


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_worker_fd_exhaustion_is_logged_and_shown_in_status(loop: str) -> None:
    cfg = FAST_CONFIG.replace("[server]\n", f'[server]\nloop = "{loop}"\n', 1)
    cfg += EXEC_WORKERS  # fdlimited lowers RLIMIT_NOFILE at import: a per-process import (exec'd workers)
    with Running(ONE + ["--app", "fdlimited:app"], config=cfg) as sup:
        assert sup.port is not None
        held = []
        try:
            for _ in range(30):
                s = socket.create_connection(("127.0.0.1", sup.port), timeout=5)
                held.append(s)
            st = sup.wait_for(lambda st: st["slots"][0]["condition"] == "degraded (fd limit)", 20,
                              "slot degraded (fd limit)")
            fds = st["slots"][0]["fds"]
            assert fds["fd_limit"] < 64 and (fds["accept_errors"] or fds["fd_limit_hits"]), fds
            if loop == "asyncio":
                assert fds["accept_errors"] > 0, fds   # exact count from asyncio's own report
            r = sup.ops("status")
            assert "degraded (fd limit)" in r.stdout, r.stdout
        finally:
            for s in held:
                s.close()
        failed = [e for e in sup.events() if e.get("event") == "accept_failed"]
        assert failed and failed[0]["error"] in ("EMFILE", "ENFILE") and "LimitNOFILE" in failed[0]["fix"]
        # and it clears once connections are gone
        sup.wait_for(lambda st: st["slots"][0]["condition"] is None, 30, "fd limit condition cleared")


def _without_dac(argv: list[str]) -> list[str]:
    """Run as this root user but without the capabilities that bypass file permissions."""
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"] + argv


def test_a_non_owner_gets_permission_denied_on_the_runtime_dir(tmp_path: Path) -> None:
    if os.geteuid() != 0 or subprocess.run(["which", "setpriv"], capture_output=True).returncode != 0:
        pytest.skip("needs root and setpriv to act as a non-owner")
    with Running(ONE) as sup:
        os.chown(sup.rt, 65534, 65534)   # now the directory belongs to someone else
        try:
            for cmd in (["status"], ["stop"], ["reload"], ["top", "--iterations", "1"]):
                r = subprocess.run(_without_dac(numaserve_argv(*cmd, "--runtime-dir", str(sup.rt))),
                                   capture_output=True, text=True, timeout=60, cwd=str(REPO))
                assert r.returncode == 1, (cmd, r.returncode, r.stderr)
                assert f"permission denied on {sup.rt}" in r.stderr and "internal error" not in r.stderr, r.stderr
        finally:
            os.chown(sup.rt, 0, 0)
        assert sup.status()["slots"][0]["state"] == "ready"


def test_a_read_only_runtime_dir_is_a_clear_error(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o700)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m,mode=0700", "tmpfs", str(ro)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        r = subprocess.run(numaserve_argv("start", "--runtime-dir", str(ro), *ONE), capture_output=True, text=True,
                           timeout=60, cwd=str(REPO))
        assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
        last = r.stderr.strip().splitlines()[-1]
        assert str(ro) in last and "read-only" in last.lower() and "internal error" not in r.stderr, last
        r = subprocess.run(numaserve_argv("stop", "--runtime-dir", str(ro)), capture_output=True, text=True,
                           timeout=60, cwd=str(REPO))
        assert r.returncode == 1 and "no supervisor is running" in r.stderr, r.stderr
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)


def test_failed_audit_writes_show_in_status_and_who_is_verified(tmp_path: Path) -> None:
    cfg = FAST_CONFIG + f'\n[ops]\naudit_log = "{tmp_path}/missing-dir/audit.log"\n'
    with Running(ONE, config=cfg) as sup:
        r = sup.ops("undrain")
        assert r.returncode == 0, r.stderr
        audit = sup.status()["supervisor"]["control_plane"]["audit"]
        assert audit["write_failures"] >= 1 and "missing-dir" in audit["last_error"], audit
    with Running(ONE) as sup:
        r = sup.ops("undrain")
        assert r.returncode == 0, r.stderr
        entries = [json.loads(x) for x in (sup.rt / "audit.log").read_text().splitlines()]
        who = entries[-1]["who"]
        assert who["verified_by"] == "SO_PEERCRED" and who["uid"] == os.getuid() and who["pid"] != os.getpid()
        assert who["claimed"]["pid"] == who["pid"]   # the CLI told the truth this time: both are recorded
