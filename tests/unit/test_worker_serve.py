"""uvicorn glue: listener wrapping, config, the guarded protocol and drain helpers (in-process)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
from typing import Any, AsyncIterator

import pytest
from worker_serving import start_serving

from numaserve.apps.demo import app as demo_app
from numaserve.framing import FramingConfig
from numaserve.worker.serve import (
    WorkerServer,
    build_config,
    loop_factory,
    open_listener,
)
from numaserve.worker.spec import WorkerSpec, flat_spec


def make_spec(**kw: Any) -> WorkerSpec:
    base: dict[str, Any] = dict(slot=0, node=0, generation=1, cpus=[0], mempolicy="local",
                                memory_nodes=[0], fd=-1, control="ipc:///nonexistent")
    base.update(kw)
    return flat_spec(**base)


def listening_socket() -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    return s


def test_loop_factory() -> None:
    import uvloop

    assert loop_factory("auto") is uvloop.new_event_loop
    assert loop_factory("uvloop") is uvloop.new_event_loop
    assert loop_factory("asyncio") is None
    with pytest.raises(ValueError):
        loop_factory("trio")


def test_open_listener_wraps_a_dup_and_makes_it_cloexec() -> None:
    with listening_socket() as lst:
        fd = os.dup(lst.fileno())
        os.set_inheritable(fd, True)
        sock = open_listener(fd)
        assert sock.fileno() == fd and not sock.get_inheritable()
        sock.close()
        # the original listener is unaffected by closing our descriptor
        assert lst.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        with socket.create_connection(lst.getsockname(), timeout=2):
            pass


@pytest.mark.parametrize("kind", ["unlistened", "udp"])
def test_open_listener_refuses_non_listeners_and_leaves_the_fd(kind: str) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM if kind == "udp" else socket.SOCK_STREAM)
    try:
        with pytest.raises(OSError):
            open_listener(s.fileno())
        os.fstat(s.fileno())  # still open: not ours to close
    finally:
        s.close()


def test_open_listener_bad_fd() -> None:
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(OSError):
        open_listener(r)


def test_build_config_maps_the_spec() -> None:
    spec = make_spec(keepalive_timeout=7.5, graceful_timeout=12.0, max_header_bytes=1234,
                     max_connections=50, access_log=True)
    cfg = build_config(spec, demo_app)
    assert cfg.timeout_keep_alive == 7.5 and cfg.timeout_graceful_shutdown == 12.0
    assert cfg.h11_max_incomplete_event_size == 1234 and cfg.limit_concurrency == 50
    assert cfg.lifespan == "auto" and cfg.server_header is False and cfg.date_header is True
    # uvicorn's access line (written at response start, no duration) is off: numaserve.accesslog writes it
    assert cfg.log_config is None and cfg.access_log is False
    assert build_config(make_spec(root_path="/api"), demo_app).root_path == "/api"
    http = cfg.http
    assert http.__name__ == "GuardedHttpToolsProtocol"  # type: ignore[union-attr]
    assert http.settings.frames.framing == spec.framing  # type: ignore[union-attr]   # frames handed over
    assert http.settings.frames.read_timeout == spec.read_timeout  # type: ignore[union-attr]
    assert build_config(make_spec(http="h11"), demo_app).http.__name__ == "SniffingH11Protocol"  # type: ignore[union-attr]
    off = build_config(make_spec(framing=FramingConfig(enabled=False)), demo_app).http
    assert off.__name__ == "GuardedHttpToolsProtocol" and off.settings.frames is None  # type: ignore[union-attr]
    assert build_config(make_spec(http="h11", framing=FramingConfig(enabled=False)), demo_app).http == "h11"
    assert build_config(make_spec(max_connections=0), demo_app).limit_concurrency is None
    # the worker's server listen()s again on the inherited socket: with uvicorn's own backlog (2048)
    # a configured server.backlog held only until the first worker started (ss showed 2048, not 123)
    assert build_config(make_spec(backlog=123), demo_app).backlog == 123


@contextlib.asynccontextmanager
async def serving(app: Any = demo_app, ws: str = "auto",
                  **spec_kw: Any) -> AsyncIterator[tuple[WorkerServer, socket.socket, list[int]]]:
    lst = listening_socket()
    started: list[int] = []
    spec = make_spec(**spec_kw)
    config = build_config(spec, app)
    config.ws = ws
    server = WorkerServer(config, on_started=lambda: started.append(1))
    task = await start_serving(server, lst)
    try:
        yield server, lst, started
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        lst.close()


async def exchange(addr: Any, data: bytes, timeout: float = 3.0) -> bytes:
    r, w = await asyncio.open_connection(*addr)
    w.write(data)
    out = b""
    try:
        while chunk := await asyncio.wait_for(r.read(65536), timeout):
            out += chunk
    finally:
        w.close()
    return out


def test_no_signal_handlers_and_started_hook() -> None:
    async def main() -> None:
        before = signal.getsignal(signal.SIGTERM)
        async with serving() as (server, lst, started):
            assert signal.getsignal(signal.SIGTERM) is before
            assert started == [1]

    asyncio.run(main())


def test_guarded_protocol_answers_431_for_a_huge_header_block() -> None:
    async def main() -> None:
        async with serving(max_header_bytes=4096) as (server, lst, _):
            out = await exchange(lst.getsockname(),
                                 b"GET / HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 20000 + b"\r\n\r\n")
            assert out.startswith(b"HTTP/1.1 431") and b"connection: close" in out
            # many small headers add up too
            many = b"".join(b"X-%d: %s\r\n" % (i, b"v" * 100) for i in range(60))
            out = await exchange(lst.getsockname(), b"GET / HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
            assert out.startswith(b"HTTP/1.1 431")
            # under the limit is served
            out = await exchange(lst.getsockname(),
                                 b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert out.startswith(b"HTTP/1.1 200")

    asyncio.run(main())


def test_guarded_protocol_header_timeout() -> None:
    async def main() -> None:
        async with serving(read_timeout=0.2) as (server, lst, _):
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            out = await exchange(lst.getsockname(), b"GET / HTTP/1.1\r\nHost: x\r\n")
            assert out.startswith(b"HTTP/1.1 408") and loop.time() - t0 < 2
            out = await exchange(lst.getsockname(), b"")  # connected, silent: closed, no answer
            assert out == b""

    asyncio.run(main())


def error_of(out: bytes) -> tuple[int, dict[str, str], dict[str, Any]]:
    """(status, lower-cased headers, the JSON error) of one raw HTTP answer."""
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert headers["content-type"] == "application/json" and int(headers["content-length"]) == len(body)
    return int(lines[0].split()[1]), headers, json.loads(body)["error"]


def test_protocol_errors_use_the_json_error_body() -> None:
    """431, 408 and uvicorn's own 400: the shape of numaserve.errors_http, connection closed."""
    async def main() -> None:
        async with serving(max_header_bytes=4096, read_timeout=0.3, framing=FramingConfig(enabled=False)) \
                as (_server, lst, _):
            addr = lst.getsockname()
            status, headers, err = error_of(await exchange(
                addr, b"GET / HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * 20000 + b"\r\n\r\n"))
            assert (status, err["type"], err["code"]) == (431, "header_too_large", 431)
            assert "server.max_header_bytes" in err["message"] and headers["connection"] == "close"
            status, _, err = error_of(await exchange(addr, b"GET / HTTP/1.1\r\nHost: x\r\n"))
            assert (status, err["type"]) == (408, "read_timeout") and "server.read_timeout" in err["message"]
            status, _, err = error_of(await exchange(addr, b"GET / HTTP/1.1\r\nHost x\r\n\r\n"))
            assert (status, err["type"], err["code"]) == (400, "protocol_error", 400)

    asyncio.run(main())


def test_connection_limit_503_uses_the_json_error_body() -> None:
    async def main() -> None:
        async with serving(max_connections=2, keepalive_timeout=30) as (_server, lst, _):
            addr = lst.getsockname()
            r, w = await asyncio.open_connection(*addr)  # with the next one, at the limit
            w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(r.readuntil(b"\r\n\r\nok"), 3)
            status, headers, err = error_of(await exchange(
                addr, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"))
            assert (status, err["type"]) == (503, "overloaded") and "server.max_connections" in err["message"]
            assert headers["connection"] == "close" and "retry-after" in headers
            w.close()

    asyncio.run(main())


def test_stop_accepting_and_shutdown_connections() -> None:
    async def main() -> None:
        async with serving(keepalive_timeout=30) as (server, lst, _):
            addr = lst.getsockname()
            r, w = await asyncio.open_connection(*addr)
            w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(r.readuntil(b"\r\n\r\nok"), 3)
            assert server.connection_count == 1
            assert server.stop_accepting() == 1
            # the listener itself is still open: this connection waits in its backlog
            r2, w2 = await asyncio.open_connection(*addr)
            w2.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(r2.read(1), 0.3)
            assert lst.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
            assert server.shutdown_connections() == 1  # the idle keep-alive one
            assert await asyncio.wait_for(r.read(), 3) == b""
            w.close()
            # the queued one is still there for whoever accepts next
            conn, _ = lst.accept()
            assert b"GET /healthz" in conn.recv(1024)
            conn.close()
            w2.close()

    asyncio.run(main())


async def ws_echo_app(scope: Any, receive: Any, send: Any) -> None:
    """Echoes text messages; remembers how the websocket ended."""
    if scope["type"] == "lifespan":
        await demo_app(scope, receive, send)
        return
    assert scope["type"] == "websocket"
    await receive()  # websocket.connect
    await send({"type": "websocket.accept"})
    while True:
        m = await receive()
        if m["type"] == "websocket.disconnect":
            WS_ENDINGS.append(m["code"])
            return
        await send({"type": "websocket.send", "text": "echo " + m["text"]})


WS_ENDINGS: list[int] = []


@pytest.mark.parametrize("ws", ["websockets-sansio", "wsproto"])
def test_websockets_outlive_shutdown_connections_and_close_1001(ws: str) -> None:
    """Drain leaves websockets open (they get the drain deadline); at the deadline they
    are closed with 1001 and the app sees websocket.disconnect 1001 (uvicorn: 1012 at once)."""
    import websockets
    from websockets.asyncio.client import connect

    async def main() -> None:
        WS_ENDINGS.clear()
        async with serving(app=ws_echo_app, ws=ws) as (server, lst, _):
            host, port = lst.getsockname()
            async with connect(f"ws://{host}:{port}/") as client:
                await client.send("a")
                assert await asyncio.wait_for(client.recv(), 3) == "echo a"
                assert server.websocket_count == 1
                assert server.shutdown_connections() == 0  # websockets are not "idle connections"
                await asyncio.sleep(0.2)
                await client.send("b")
                assert await asyncio.wait_for(client.recv(), 3) == "echo b"
                assert server.close_websockets(1001) == 1
                with pytest.raises(websockets.ConnectionClosed) as info:
                    await asyncio.wait_for(client.recv(), 3)
                assert info.value.rcvd is not None and info.value.rcvd.code == 1001
            for _ in range(100):
                if WS_ENDINGS:
                    break
                await asyncio.sleep(0.02)
            assert WS_ENDINGS == [1001]

    asyncio.run(main())
