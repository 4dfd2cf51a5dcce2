"""Frames and HTTP on one port in-process (numaserve/worker/sniff.py), on asyncio and uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any, AsyncIterator, Callable

import pytest
import uvloop

from numaserve.client import AsyncFrameClient, FrameClient, FrameClientError, Request
from numaserve.framing import HEADER, FramingConfig, decode_response, encode_frame, encode_request
from numaserve.worker.middleware import BodyLimitMiddleware, MetricsMiddleware
from numaserve.worker.serve import WorkerServer, build_config
from numaserve.worker.spec import WorkerSpec, flat_spec
from numaserve.worker.stats import WorkerStats

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


#: /slow requests in the app now, and the most at once (what pipelining and its limit allow)
SLOW = {"now": 0, "peak": 0}


async def echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            m = await receive()
            if m["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    path = scope["path"]
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    if path == "/boom":
        raise RuntimeError("boom")
    if path == "/noresp":
        return
    if path == "/slow":
        SLOW["now"] += 1
        SLOW["peak"] = max(SLOW["peak"], SLOW["now"])
        try:
            await asyncio.sleep(int(scope["query_string"].split(b"=")[1]) / 1000)
        finally:
            SLOW["now"] -= 1
    out = body if path == "/echo" else f"{scope['method']} {path} {scope['scheme']}".encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(out)).encode())]})
    half = len(out) // 2
    await send({"type": "http.response.body", "body": out[:half], "more_body": True})
    await send({"type": "http.response.body", "body": out[half:], "more_body": False})


def make_spec(**kw: Any) -> WorkerSpec:
    base: dict[str, Any] = dict(slot=0, node=0, generation=1, cpus=[0], mempolicy="local",
                                memory_nodes=[0], fd=-1, control="ipc:///nonexistent", read_timeout=5.0,
                                max_body_bytes=1 << 20)
    base.update(kw)
    return flat_spec(**base)


@contextlib.asynccontextmanager
async def serving(**spec_kw: Any) -> AsyncIterator[tuple[WorkerServer, int, WorkerStats]]:
    spec = make_spec(**spec_kw)
    stats = WorkerStats()
    app = MetricsMiddleware(BodyLimitMiddleware(echo_app, spec.max_body_bytes, spec.read_timeout, stats), stats)
    server = WorkerServer(build_config(spec, app, stats=stats))
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(64)
    task = asyncio.ensure_future(server.serve(sockets=[lst]))
    try:
        for _ in range(300):
            if server.started:
                break
            await asyncio.sleep(0.01)
        assert server.started
        yield server, lst.getsockname()[1], stats
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        lst.close()


def run(loop: str, coro: Any) -> None:
    with asyncio.Runner(loop_factory=LOOPS[loop]) as r:
        r.run(coro)


async def http_get(port: int, path: str) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    out = await asyncio.wait_for(r.read(), 5)
    w.close()
    return out


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn)


@pytest.fixture(params=sorted(LOOPS))
def loop(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_http_and_frames_share_the_port(loop: str) -> None:
    async def main() -> None:
        async with serving() as (_, port, stats):
            assert (await http_get(port, "/a")).startswith(b"HTTP/1.1 200")
            async with AsyncFrameClient("127.0.0.1", port) as c:
                r = await c.request("GET", "/b")
                assert (r.status, r.body, r.header("content-type")) == (200, b"GET /b http", "text/plain")
                r = await c.request("POST", "/echo", body=b"\x00\xffbinary")
                assert r.body == b"\x00\xffbinary"
            async with AsyncFrameClient("127.0.0.1", port, encoding="json") as c:
                r = await c.request("POST", "/echo", body={"k": [1, 2]})
                assert r.status == 200 and r.json() == {"k": [1, 2]}

            def sync() -> None:
                with FrameClient("127.0.0.1", port) as fc:
                    assert fc.request("GET", "/c").body == b"GET /c http"
                    assert fc.request("GET", "/d").body == b"GET /d http"  # same connection reused
            await in_thread(sync)
            assert stats.requests == 6  # frames went through the same middleware as HTTP
            assert (await http_get(port, "/e")).startswith(b"HTTP/1.1 200")
    run(loop, main())


def test_pipelining_out_of_order_replies(loop: str) -> None:
    async def main() -> None:
        async with serving() as (_, port, _stats):
            async with AsyncFrameClient("127.0.0.1", port) as c:
                SLOW["peak"] = 0
                delays = [200, 10, 150, 0, 100] * 4
                done: list[int] = []

                async def one(d: int) -> Any:
                    r = await c.request("GET", f"/slow?ms={d}")
                    done.append(d)
                    return r

                rs = await asyncio.gather(*(one(d) for d in delays))
                assert all(r.status == 200 and r.body == b"GET /slow http" for r in rs)
                # concurrent, answered as each finishes: the quick ones first, not in request order
                assert SLOW["peak"] >= 8, SLOW
                assert sorted(done[:4]) == [0, 0, 0, 0] and done[-1] == 200, done

            def sync() -> list[Any]:
                with FrameClient("127.0.0.1", port) as fc:
                    return fc.pipeline([Request("GET", "/slow?ms=100"), Request("POST", "/echo", body=b"x"),
                                        Request("GET", "/slow?ms=0")])
            rs = await in_thread(sync)
            assert [r.body for r in rs] == [b"GET /slow http", b"x", b"GET /slow http"]
    run(loop, main())


def test_pipeline_limit_applies_backpressure(loop: str) -> None:
    async def main() -> None:
        async with serving(framing=FramingConfig(max_pipeline=2)) as (_, port, _stats):
            async with AsyncFrameClient("127.0.0.1", port) as c:
                SLOW["peak"] = 0
                rs = await asyncio.gather(*(c.request("GET", "/slow?ms=100") for _ in range(6)))
                assert all(r.status == 200 for r in rs)
                assert SLOW["peak"] == 2  # never more than max_pipeline in the app at once
    run(loop, main())


def test_oversized_frame_gets_413_and_close_then_serving_goes_on(loop: str) -> None:
    async def main() -> None:
        async with serving(framing=FramingConfig(max_frame_bytes=1000)) as (_, port, _stats):
            def sync() -> None:
                with FrameClient("127.0.0.1", port, encoding="json") as fc:
                    fc.send_raw(HEADER.pack(5000) + b'{"id":1')
                    r = fc.read_response()
                    assert r.status == 413 and "exceeds" in (r.error or "")
                    with pytest.raises(FrameClientError):
                        fc.read_response()  # closed
                with FrameClient("127.0.0.1", port) as fc:
                    assert fc.request("GET", "/ok").status == 200
            await in_thread(sync)
    run(loop, main())


def test_truncated_frame_times_out_with_408_and_eof_mid_frame_closes(loop: str) -> None:
    async def main() -> None:
        async with serving(read_timeout=0.3) as (_, port, _stats):
            def sync() -> None:
                with FrameClient("127.0.0.1", port) as fc:
                    frame = encode_frame(encode_request(1, "GET", "/x"))
                    fc.send_raw(frame[:-3])
                    r = fc.read_response()
                    assert r.status == 408  # the read timeout answered; the client did not wait forever
                    with pytest.raises(FrameClientError):
                        fc.read_response()
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(frame[:6])
                s.shutdown(socket.SHUT_WR)
                s.settimeout(3)
                assert s.recv(100) == b""  # closed without an answer
                s.close()
                with FrameClient("127.0.0.1", port) as fc:
                    assert fc.request("GET", "/ok").status == 200
            await in_thread(sync)
    run(loop, main())


def test_bad_payload_is_400_and_close_after_in_flight_replies(loop: str) -> None:
    async def main() -> None:
        async with serving() as (_, port, _stats):
            def sync() -> None:
                with FrameClient("127.0.0.1", port, encoding="json") as fc:
                    fc.send_raw(encode_frame(encode_request(1, "GET", "/slow?ms=150", as_json=True))
                                + encode_frame(b'{"id": 2, "method": 3}'))
                    first = fc.read_response()
                    assert (first.id, first.status) == (2, 400)
                    assert first.json()["error"]["type"] == "protocol_error"
                    second = fc.read_response()
                    assert (second.id, second.status) == (1, 200)  # in-flight request still answered
                    with pytest.raises(FrameClientError):
                        fc.read_response()
            await in_thread(sync)
    run(loop, main())


def test_app_errors_timeouts_and_limits_use_the_error_classes(loop: str) -> None:
    async def main() -> None:
        async with serving(max_connections=3) as (_, port, stats):
            async with AsyncFrameClient("127.0.0.1", port) as c:
                r = await c.request("GET", "/boom")
                assert r.status == 500 and r.json()["error"]["type"] == "internal"
                r = await c.request("GET", "/noresp")
                assert r.status == 500
                r = await c.request("GET", "/slow?ms=2000", timeout=0.2)
                assert r.status == 504 and r.json()["error"]["type"] == "timeout"
                assert r.header("x-numaserve-refusal") == "deadline"   # why: numaserve.refusals
                rs = await asyncio.gather(*(c.request("GET", "/slow?ms=200") for _ in range(5)))
                statuses = sorted(r.status for r in rs)
                assert 503 in statuses and 200 in statuses
                assert all(r.header("retry-after") for r in rs if r.status == 503)
                assert all(r.header("x-numaserve-refusal") == "connections" for r in rs if r.status == 503)
                assert (await c.request("GET", "/still-open")).status == 200
            body = b"x" * ((1 << 20) + 1)
            async with AsyncFrameClient("127.0.0.1", port) as c:
                r = await c.request("POST", "/echo", body=body)  # frame limit 1 MiB default
            assert r.status == 413
            assert stats.status_classes.get("5xx", 0) >= 2
    run(loop, main())


def test_body_limit_middleware_applies_to_frames(loop: str) -> None:
    async def main() -> None:
        async with serving(max_body_bytes=100) as (_, port, _stats):
            async with AsyncFrameClient("127.0.0.1", port) as c:
                r = await c.request("POST", "/echo", body=b"y" * 200)
                assert r.status == 413
    run(loop, main())


def test_drain_closes_idle_frame_connections(loop: str) -> None:
    async def main() -> None:
        async with serving() as (server, port, _stats):
            c = AsyncFrameClient("127.0.0.1", port)
            assert (await c.request("GET", "/x")).status == 200
            assert server.connection_count == 1
            pending = asyncio.ensure_future(c.request("GET", "/slow?ms=200"))
            await asyncio.sleep(0.05)
            server.shutdown_connections()
            assert (await pending).status == 200  # busy: answered first, then closed
            await asyncio.sleep(0.1)
            assert server.connection_count == 0
            assert (await c.request("GET", "/x")).status == 200  # the client reconnects
            await c.close()
    run(loop, main())


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_frame_connection_outlives_the_http_protocols_read_timer(loop: str, http: str) -> None:
    """Every connection starts as the HTTP protocol, whose timer closes a connection silent for
    ``read_timeout``; once frames took the connection over, that timer is gone and the HTTP
    protocol is no longer counted: the same socket serves frames past ``read_timeout``."""
    async def ask(r: asyncio.StreamReader, w: asyncio.StreamWriter, rid: int) -> dict[str, Any]:
        w.write(encode_frame(encode_request(rid, "GET", f"/f{rid}")))
        n = HEADER.unpack(await asyncio.wait_for(r.readexactly(HEADER.size), 5))[0]
        return decode_response(await asyncio.wait_for(r.readexactly(n), 5))

    async def main() -> None:
        async with serving(http=http, read_timeout=0.3) as (server, port, _stats):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            assert (await ask(r, w, 1))["status"] == 200
            assert server.connection_count == 1
            await asyncio.sleep(0.8)     # past read_timeout, well inside [framing] idle_timeout
            got = await ask(r, w, 2)
            assert (got["id"], got["status"], got["body"]) == (2, 200, b"GET /f2 http")
            assert server.connection_count == 1
            w.close()
    run(loop, main())


def test_silent_connection_is_closed_after_read_timeout(loop: str) -> None:
    async def main() -> None:
        async with serving(read_timeout=0.2) as (server, port, _stats):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            assert await asyncio.wait_for(r.read(), 3) == b""
            w.close()
    run(loop, main())


def test_tls_serves_http_and_frames(loop: str, tmp_path: Any) -> None:
    import ssl
    import subprocess

    from numaserve.worker.tls import TlsConfig

    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True)
    ctx = ssl.create_default_context(cafile=str(cert))

    async def main() -> None:
        async with serving(tls=TlsConfig(certfile=str(cert), keyfile=str(key))) as (_, port, _stats):
            async with AsyncFrameClient("127.0.0.1", port, ssl=ctx, server_hostname="localhost") as c:
                r = await c.request("GET", "/t")
                assert r.body == b"GET /t https"
            rd, w = await asyncio.open_connection("127.0.0.1", port, ssl=ctx, server_hostname="localhost")
            w.write(b"GET /h HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            out = await asyncio.wait_for(rd.read(), 5)
            assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"GET /h https")
            w.close()
    run(loop, main())


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_empty_lines_before_the_request_line_are_http(loop: str, http: str) -> None:
    """RFC 9112 §2.2: a server SHOULD ignore at least one empty line before a request line."""
    request = b"GET /a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"

    async def send_parts(port: int, *parts: bytes) -> bytes:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        for part in parts:
            w.write(part)
            await w.drain()
            await asyncio.sleep(0.05)  # separate reads on the server
        out = await asyncio.wait_for(r.read(), 5)
        w.close()
        return out

    async def main() -> None:
        async with serving(http=http) as (_, port, stats):
            for parts in ([b"\r\n" + request], [b"\n\r\n\r\n" + request], [b"\r\n", b"\r\n", request]):
                out = await send_parts(port, *parts)
                assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"GET /a http"), (parts, out[:60])
            # what follows empty lines is HTTP or nothing: a frame cannot start with CR/LF
            out = await send_parts(port, b"\r\n" + encode_frame(encode_request(1, "GET", "/")))
            assert out.startswith(b"HTTP/1.1 400")
            assert await send_parts(port, b"\r\n" * 600) == b""  # an endless stream of empty lines: closed
            assert stats.requests == 3
            async with AsyncFrameClient("127.0.0.1", port) as c:  # frames unaffected
                assert (await c.request("GET", "/b")).status == 200
    run(loop, main())


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_frames_can_be_switched_off(loop: str, http: str) -> None:
    """With ``[framing] enabled = false`` a frame is just bytes HTTP cannot parse: 400, and HTTP serves."""
    async def main() -> None:
        async with serving(http=http, framing=FramingConfig(enabled=False)) as (_, port, stats):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(encode_frame(encode_request(1, "GET", "/")))
            out = await asyncio.wait_for(r.read(), 5)
            w.close()
            assert out.startswith(b"HTTP/1.1 400"), out[:80]
            assert (await http_get(port, "/a")).startswith(b"HTTP/1.1 200")
    run(loop, main())


def test_half_closed_client_gets_every_buffered_reply(loop: str) -> None:
    async def main() -> None:
        async with serving(framing=FramingConfig(max_pipeline=2)) as (_, port, _stats):
            def sync() -> list[int]:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"".join(encode_frame(encode_request(i, "GET", "/slow?ms=50")) for i in range(5)))
                s.shutdown(socket.SHUT_WR)
                from numaserve.framing import FrameDecoder, decode_response
                d, ids = FrameDecoder(1 << 20), []
                while chunk := s.recv(65536):
                    ids += [decode_response(p)["id"] for p in d.feed(chunk)]
                s.close()
                return ids
            assert sorted(await in_thread(sync)) == [0, 1, 2, 3, 4]
    run(loop, main())
