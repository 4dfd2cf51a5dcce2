"""The admin endpoint's h11 server over real sockets: keep-alive, pipelining, HTTP/1.0, bad requests."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from typing import Any

from numaserve.supervisor.admin import AdminConfig, LoopHeartbeat, start_admin


class Sup:
    stopping = False
    state = "running"

    def status(self) -> dict[str, Any]:
        return {"supervisor": {"state": "running"}, "slots": []}


async def _admin(**kw: Any) -> Any:
    handle = await start_admin(Sup(), AdminConfig(bind="127.0.0.1:0", **kw), heartbeat=LoopHeartbeat())
    assert handle is not None
    host, port = handle.address.rsplit(":", 1)
    return handle, host, int(port)


async def _read_all(r: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(r.read(), 5)


def test_keep_alive_pipelining_head_and_405_on_one_connection() -> None:
    async def go() -> None:
        handle, host, port = await _admin()
        try:
            r, w = await asyncio.open_connection(host, port)
            w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                    b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
                    b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
                    b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = await _read_all(r)  # the last request asked to close: EOF after its answer
            assert re.findall(rb"HTTP/1.1 (\d{3}) ", data) == [b"200", b"200", b"405", b"404"], data
            assert data.count(b'"status": "ok"') == 1 and b'"status": "ready"' not in data  # HEAD: no body
            assert b"allow: GET, HEAD" in data
            w.close()
        finally:
            await handle.stop()

    asyncio.run(go())


def test_http10_closes_and_garbage_gets_400() -> None:
    async def go() -> None:
        handle, host, port = await _admin()
        try:
            r, w = await asyncio.open_connection(host, port)
            w.write(b"GET /healthz HTTP/1.0\r\n\r\n")
            data = await _read_all(r)
            assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"\n"), data
            w.close()
            r, w = await asyncio.open_connection(host, port)  # half-closed after the request: answered
            w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            w.write_eof()
            data = await _read_all(r)
            assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"\n"), data
            w.close()
            r, w = await asyncio.open_connection(host, port)
            w.write(b"this is not http\r\n\r\n")
            data = await _read_all(r)
            assert data.startswith(b"HTTP/1.1 400 ") and b"bad request" in data, data
            w.close()
            r, w = await asyncio.open_connection(host, port)  # a head that never ends: 431, closed
            w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 40000)
            data = await _read_all(r)
            assert data.split(b" ")[1] in (b"400", b"431"), data[:80]
            w.close()
            assert handle.connections_status()["open"] == 0
        finally:
            await handle.stop()

    asyncio.run(go())


def test_real_client_and_stop_closes_kept_alive_connections() -> None:
    async def go() -> None:
        handle, host, port = await _admin()
        url = f"http://{host}:{port}/healthz"
        out = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", (
            "import httpx, sys\n"
            "with httpx.Client() as c:\n"
            "    codes = [c.get(sys.argv[1]).status_code for _ in range(3)]\n"
            "print(codes)\n"), url], capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "[200, 200, 200]", out.stderr
        r, w = await asyncio.open_connection(host, port)
        w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await asyncio.wait_for(r.readuntil(b"\r\n"), 5)).startswith(b"HTTP/1.1 200")
        await handle.stop()  # the idle kept-alive connection is closed, the port refuses
        rest = await asyncio.wait_for(r.read(), 5)  # EOF (times out if the server kept it open)
        assert b"HTTP/1.1" not in rest
        assert handle.task.done()
        try:
            await asyncio.open_connection(host, port)
            raise AssertionError("still listening after stop")
        except OSError:
            pass
        w.close()

    asyncio.run(go())


def test_no_uvicorn_in_the_admin_path() -> None:
    """The point of the module: starting the endpoint imports h11, not uvicorn."""
    code = ("import asyncio, sys\n"
            "from numaserve.supervisor.admin import AdminConfig, LoopHeartbeat, start_admin\n"
            "class S:\n stopping = False\n state = 'running'\n def status(self): return {'slots': []}\n"
            "async def go():\n"
            " h = await start_admin(S(), AdminConfig(bind='127.0.0.1:0'), heartbeat=LoopHeartbeat())\n"
            " await h.stop()\n"
            "asyncio.run(go())\n"
            "print('uvicorn' in sys.modules, 'h11' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False)
    assert out.stdout.strip().splitlines()[-1] == "False True", out.stdout + out.stderr
