"""The small parts of the control-plane hardening, on fixtures and fakes."""

from __future__ import annotations

import asyncio
import math
import os
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from numaserve.control import messages as m
from numaserve.control.checks import heartbeat_problem, stats_problem
from numaserve.control.peercred import PeerCred, parse_peer_address, peer_cred
from numaserve.supervisor import fdbudget
from numaserve.supervisor.curvekeys import AuthorizedKeys
from numaserve.supervisor.ratelimit import PeerRateLimiter
from numaserve.control.workerauth import (
    TOKEN_FD_ENV,
    check_hello,
    check_sender,
    new_token,
    read_token,
    take_token,
    token_pipe,
)

# ------------------------------------------------------------------ rate limit


def test_rate_limiter_gives_each_peer_its_own_bucket() -> None:
    now = [0.0]
    rl = PeerRateLimiter(10, 3, clock=lambda: now[0])
    assert [rl.allow("a")[0] for _ in range(4)] == [True, True, True, False]
    assert rl.allow("b")[0]                       # another peer is not affected
    ok, retry = rl.allow("a")
    assert not ok and retry == pytest.approx(0.1)
    now[0] = 0.1
    assert rl.allow("a")[0] and not rl.allow("a")[0]
    now[0] = 100.0                                 # refills to the burst, not beyond
    assert [rl.allow("a")[0] for _ in range(4)] == [True, True, True, False]
    assert rl.limited == 4


def test_rate_limiter_table_is_bounded() -> None:
    rl = PeerRateLimiter(1, 1, max_peers=100)
    for i in range(1000):
        rl.allow(i)
    assert len(rl) == 100
    with pytest.raises(ValueError):
        PeerRateLimiter(math.nan, 1)


# --------------------------------------------------------------- peer / token


def test_peer_address_parsing() -> None:
    assert parse_peer_address("localhost:1000:1001:4242") == PeerCred(1000, 1001, 4242)
    assert parse_peer_address(":0:0:7") == PeerCred(0, 0, 7)
    for text in (None, "", "127.0.0.1", "localhost:a:b:c", "localhost:1:2", "x:1:2:0", "x:-1:2:3"):
        assert parse_peer_address(text) is None
    assert peer_cred(b"raw bytes") is None


def test_peer_cred_of_a_real_ipc_connection(tmp_path: Path) -> None:
    import zmq

    ctx = zmq.Context()
    try:
        r = ctx.socket(zmq.ROUTER)
        r.bind(f"ipc://{tmp_path}/p.sock")
        d = ctx.socket(zmq.DEALER)
        d.connect(f"ipc://{tmp_path}/p.sock")
        d.send(b"hi")
        assert r.poll(5000)
        frames = r.recv_multipart(copy=False)
        assert peer_cred(frames[-1]) == PeerCred(os.getuid(), os.getgid(), os.getpid())
        r.close(0)
        d.close(0)
    finally:
        ctx.term()


def test_token_travels_through_a_pipe_and_is_gone_after() -> None:
    token = new_token()
    assert len(token) == 32 and token != new_token()
    fd = token_pipe(token)
    env = {TOKEN_FD_ENV: str(fd)}
    assert take_token(env) == token
    assert TOKEN_FD_ENV not in env
    with pytest.raises(OSError):
        os.fstat(fd)                               # closed
    assert take_token({}) == "" and take_token({TOKEN_FD_ENV: "x"}) == "" and read_token(-1) == ""


def test_hello_checks() -> None:
    hello = m.Hello(slot=0, generation=1, pid=100, token="t" * 32)
    assert check_hello(hello, expected_pid=100, expected_token="t" * 32, peer=PeerCred(0, 0, 100)) is None
    assert "SO_PEERCRED" in check_hello(hello, expected_pid=100, expected_token="t" * 32, peer=PeerCred(0, 0, 5))
    assert "token" in check_hello(hello, expected_pid=100, expected_token="u" * 32, peer=None)
    assert "token" in check_hello(m.Hello(slot=0, generation=1, pid=100), expected_pid=100,
                                  expected_token="t" * 32, peer=None)
    assert "names pid" in check_hello(m.Hello(slot=0, generation=1, pid=7, token="t" * 32), expected_pid=100,
                                      expected_token="t" * 32, peer=None)
    assert check_sender(100, None) is None and check_sender(100, PeerCred(0, 0, 100)) is None
    assert check_sender(100, PeerCred(0, 0, 101))


# ---------------------------------------------------------------------- checks


def _stats(**kw: Any) -> m.Stats:
    return m.Stats(slot=0, generation=1, requests=kw.pop("requests", 1), inflight=kw.pop("inflight", 0), **kw)


def test_stats_and_heartbeat_value_checks() -> None:
    assert stats_problem(_stats()) is None
    assert stats_problem(_stats(extra={"latency_buckets": [1, 2], "latency_sum_ms": 3.5, "latency_count": 2,
                                       "admission": {"shed": {"quota": 1}, "admitted": 3, "limit": 4},
                                       "fd_limited": True, "fds_open": 3, "fd_limit": 1024})) is None
    for bad in (_stats(requests=-1), _stats(latency_ms={"p50": math.nan}), _stats(status_classes={"2xx": -2}),
                _stats(extra={"latency_buckets": [1, -1]}), _stats(extra={"latency_buckets": [0] * 10_000}),
                _stats(extra={"latency_sum_ms": math.inf}), _stats(extra={"latency_count": "7"}),
                _stats(extra={"admission": {"shed": {"x": "y"}}}), _stats(extra={"admission": [1]}),
                _stats(extra={"admission": {"limit": math.nan}}), _stats(extra={"connections_local": True})):
        assert stats_problem(bad), bad
    assert heartbeat_problem(m.Heartbeat(slot=0, generation=1, loop_lag=0.1, mono=5.0)) is None
    assert heartbeat_problem(m.Heartbeat(slot=0, generation=1, loop_lag=math.nan, mono=5.0))
    assert heartbeat_problem(m.Heartbeat(slot=0, generation=1, loop_lag=0.0, mono=math.inf))
    assert heartbeat_problem(m.Heartbeat(slot=0, generation=1, loop_lag=-1.0, mono=1.0))


def test_decoder_refuses_non_bytes_and_deep_nesting() -> None:
    with pytest.raises(m.BadMessage):
        m.decode_from_worker("text")  # type: ignore[arg-type]
    with pytest.raises(m.BadMessage):
        m.decode_from_worker(b"\x91" * 100_000)
    with pytest.raises(m.BadMessage):
        m.decode_ops_request(b"\x00" * (m.MAX_MESSAGE_BYTES + 1))


# ------------------------------------------------------------------- fd budget


def test_caps_fit_under_the_limit_or_are_scaled_down_together() -> None:
    wanted = {"admin": (64, 1), "ops-ro": (16, 3), "events": (16, 3)}
    roomy = fdbudget.plan_caps(65536, 40, 4, wanted)
    assert roomy.caps == {"admin": 64, "ops-ro": 16, "events": 16} and not roomy.scaled
    tight = fdbudget.plan_caps(256, 40, 2, wanted)
    cost = sum(tight.caps[k] * per for k, (_, per) in wanted.items())
    assert cost + tight.needed_by_supervisor <= 256
    tiny = fdbudget.plan_caps(90, 40, 2, wanted)
    assert tiny.scaled and all(c >= 1 for c in tiny.caps.values())
    assert tiny.to_json()["scaled_down"] is True


def test_hex_addresses_from_proc_net() -> None:
    assert fdbudget._hex_addr("0100007F:1F90") == "127.0.0.1:8080"
    assert fdbudget._hex_addr("00000000000000000000000001000000:0050") == "[::1]:80"
    assert fdbudget._hex_addr("zz:zz") == "zz:zz"


def test_describe_fds_groups_what_this_process_holds(tmp_path: Path) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    r, w = os.pipe()
    try:
        held = fdbudget.describe_fds(top=50)
        port = srv.getsockname()[1]
        assert held.get(f"tcp 127.0.0.1:{port} listen") == 1, held
        assert held.get("pipe", 0) >= 2
        assert fdbudget.count_open_fds() is not None
    finally:
        srv.close()
        os.close(r)
        os.close(w)


def test_fd_watch_logs_once_per_episode(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(fdbudget, "log", SimpleNamespace(
        error=lambda e, **kw: events.append((e, kw)), info=lambda e, **kw: events.append((e, kw))))
    count = [10]
    watch = fdbudget.FdWatch(limit=100, counter=lambda: count[0], describe=lambda: {"pipe": 3})
    try:
        watch.tick()
        assert not watch.pressure and events == []
        count[0] = 90
        watch.tick()
        watch.tick()
        assert watch.pressure and [e for e, _ in events] == ["fd_pressure"]
        assert events[0][1]["held_by"] == {"pipe": 3} and "LimitNOFILE" in events[0][1]["fix"]
        count[0] = 50
        watch.tick()
        assert not watch.pressure and events[-1][0] == "fd_pressure_over"
        watch.note_exhaustion("spawn", OSError(24, "Too many open files"))
        watch.note_exhaustion("spawn", OSError(24, "Too many open files"))   # same second: counted once
        assert watch.exhaustion == 1 and [e for e, _ in events].count("fd_exhausted") == 1
        assert watch.status()["last_exhausted"] == "spawn: Too many open files"
        count[0] = None  # type: ignore[assignment]   # /proc unreadable: at the limit
        watch.pressure = False
        watch.tick()
        assert watch.open_fds == 100 and watch.pressure
    finally:
        watch.close()
    assert fdbudget.is_fd_exhaustion(OSError(24, "x")) and not fdbudget.is_fd_exhaustion(OSError(2, "x"))


# ------------------------------------------------------------------ curve keys


def test_authorized_keys_reload_and_fail_closed(tmp_path: Path) -> None:
    import zmq.auth

    d = tmp_path / "keys"
    d.mkdir()
    pub_a, _ = zmq.auth.create_certificates(str(tmp_path), "a")
    pub_b, _ = zmq.auth.create_certificates(str(tmp_path), "b")
    (d / "a.key").write_text(Path(pub_a).read_text())
    (d / "b.key").write_text(Path(pub_b).read_text())
    (d / "broken.key").write_text("not a certificate")
    keys = AuthorizedKeys(str(d))
    change = keys.load()
    key_a = zmq.auth.load_certificate(pub_a)[0]
    key_b = zmq.auth.load_certificate(pub_b)[0]
    assert change.total == 2 and change.added == 2 and any("broken.key" in p for p in change.problems)
    assert keys.callback("*", key_a) and keys.callback("*", key_b)
    (d / "b.key").unlink()
    change = keys.load()
    assert change.removed == 1 and keys.callback("*", key_a) and not keys.callback("*", key_b)
    import shutil

    shutil.rmtree(d)
    change = keys.load()                               # the directory is gone: nobody gets in
    assert change.total == 0 and not keys.callback("*", key_a) and change.problems


# ----------------------------------------------------------------- front door


def test_front_door_splices_caps_evicts_and_limits_bytes(tmp_path: Path) -> None:
    from numaserve.supervisor.frontdoor import FrontDoor, bind_unix

    async def go() -> None:
        backend = str(tmp_path / "backend.sock")

        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()

        server = await asyncio.start_unix_server(echo, backend)
        door = FrontDoor("t", bind_unix(str(tmp_path / "front.sock")), backend, max_connections=2,
                         idle_timeout=0.6, max_client_bytes=10_000)
        await door.start()
        try:
            r1, w1 = await asyncio.open_unix_connection(str(tmp_path / "front.sock"))
            w1.write(b"hello")
            assert await asyncio.wait_for(r1.readexactly(5), 5) == b"hello"   # spliced both ways
            r2, w2 = await asyncio.open_unix_connection(str(tmp_path / "front.sock"))
            w2.write(b"x")
            await asyncio.wait_for(r2.readexactly(1), 5)
            # full, both busy: a third is closed at once
            r3, w3 = await asyncio.open_unix_connection(str(tmp_path / "front.sock"))
            assert await asyncio.wait_for(r3.read(), 5) == b""
            assert door.refused == 1
            await asyncio.sleep(1.1)   # both quiet now: a new one evicts the oldest
            r4, w4 = await asyncio.open_unix_connection(str(tmp_path / "front.sock"))
            w4.write(b"y")
            assert await asyncio.wait_for(r4.readexactly(1), 5) == b"y"
            assert door.evicted >= 1 or door.idle_closed >= 1
            # a client that sends more than its budget is cut off
            w4.write(b"z" * 20_000)
            data = await asyncio.wait_for(r4.read(), 5)
            assert len(data) < 20_000 and door.over_budget == 1
            await asyncio.sleep(1.5)   # idle connections are closed
            assert door.status()["connections"] == 0 and door.idle_closed >= 1
            for w in (w1, w2, w3, w4):
                w.close()
        finally:
            await door.stop()
            server.close()
        assert not (tmp_path / "front.sock").exists()

    asyncio.run(go())


def test_tcp_endpoint_parsing() -> None:
    from numaserve.supervisor.frontdoor import parse_tcp_endpoint

    assert parse_tcp_endpoint("tcp://127.0.0.1:7071") == ("127.0.0.1", 7071)
    assert parse_tcp_endpoint("tcp://*:7071") == ("0.0.0.0", 7071)
    assert parse_tcp_endpoint("tcp://[::1]:7071") == ("::1", 7071)
    for bad in ("udp://x:1", "tcp://host", "tcp://h:99999"):
        with pytest.raises(ValueError):
            parse_tcp_endpoint(bad)


# ---------------------------------------------------------------- admin guard


class _Proto:
    def __init__(self, idle: bool) -> None:
        self._idle = idle
        self.closed = False

    def idle(self) -> bool:
        return self._idle

    def close_idle(self) -> None:
        self.closed = True


def test_admin_guard_evicts_the_oldest_idle_or_refuses() -> None:
    from numaserve.supervisor.admin import ConnectionGuard

    g = ConnectionGuard(2, 5.0)
    a, b, c, d = _Proto(True), _Proto(False), _Proto(False), _Proto(False)
    assert g.admit(a) and g.admit(b)
    assert g.admit(c) and a.closed and g.evicted == 1          # a was idle: made room
    assert not g.admit(d) and g.refused == 1                   # b and c busy: d refused
    g.forget(b)
    assert g.admit(d)
    assert g.status() == {"open": 2, "max_connections": 2, "accepted": 4, "refused": 1, "evicted_idle": 1,
                          "closed_idle": 0}


def test_admin_server_closes_idle_and_excess_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    from numaserve.supervisor import admin as admin_mod

    monkeypatch.setattr(admin_mod, "ADMIN_IDLE_TIMEOUT", 0.5)
    from numaserve.supervisor.admin import AdminConfig, LoopHeartbeat, start_admin

    class Sup:
        stopping = False
        state = "running"

        def status(self) -> dict[str, Any]:
            return {"supervisor": {}, "slots": []}

    async def go() -> None:
        handle = await start_admin(Sup(), AdminConfig(bind="127.0.0.1:0"), heartbeat=LoopHeartbeat(),
                                   max_connections=3)
        assert handle is not None
        host, port = handle.address.rsplit(":", 1)
        try:
            idle = [await asyncio.open_connection(host, int(port)) for _ in range(10)]
            await asyncio.sleep(0.2)
            assert handle.guard is not None and len(handle.guard.open) <= 3
            r, w = await asyncio.open_connection(host, int(port))
            w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(r.readuntil(b"\r\n"), 5)
            assert b"200" in head
            await asyncio.sleep(1.2)      # idle past idle_timeout: closed by the server
            for rr, _ in idle:
                assert await asyncio.wait_for(rr.read(), 5) == b""
            st = handle.connections_status()
            assert st["evicted_idle"] >= 7 and st["closed_idle"] >= 1, st
            for _, ww in idle + [(r, w)]:
                ww.close()
        finally:
            await handle.stop()

    asyncio.run(go())
