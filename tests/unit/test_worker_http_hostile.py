"""The worker's HTTP edge under hostile input (issue 34, items 5-7 and 9), on real sockets.

Served the way the worker serves (``build_stack`` with the "cpu" limiter),
raw bytes from a client socket: big pipelined reads, malformed framing,
non-HTTP first bytes.  Every answer is read by the client (a lingering close,
not a reset) and nothing leaves the gate counting a request in flight.
"""

from __future__ import annotations

import asyncio
import re
import socket
import sys
from typing import Any

from test_worker_permits import serving, settled


async def talk(addr: tuple[str, int], raw: bytes, *, until: int = 0, timeout: float = 20.0,
               more: bytes = b"", done: Any = None) -> tuple[bytes, str]:
    """Send ``raw`` (then ``more``), read until EOF, ``until`` answers or ``timeout``: (bytes read,
    how the connection ended: "eof", "reset" or "open")."""
    s = socket.create_connection(addr)
    s.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_sendall(s, raw)
        if more:
            await loop.sock_sendall(s, more)
        out = b""
        end = loop.time() + timeout
        while loop.time() < end:
            try:
                d = await asyncio.wait_for(loop.sock_recv(s, 1 << 20), max(0.01, end - loop.time()))
            except TimeoutError:
                return out, "open"
            except ConnectionResetError:
                return out, "reset"
            if not d:
                return out, "eof"
            out += d
            if (until and out.count(b"HTTP/1.1 ") >= until) or (done is not None and done(out)):
                return out, "open"
        return out, "open"
    finally:
        s.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# --- item 5: header limits count the current request's head only ---------------------------------

def test_5000_pipelined_gets_in_one_write_are_answered_in_order() -> None:
    async def main() -> None:
        async with serving() as (stack, addr):
            raw = b"".join(b"GET /p%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(5000))
            out, _ = await talk(addr, raw, until=5000, timeout=120)
            paths = re.findall(rb"\r\n\r\n(/p\d+)", out)
            assert paths == [b"/p%d" % i for i in range(5000)]
            assert out.count(b"HTTP/1.1 200 ") == 5000
            await settled(stack)

    run(main())


def test_a_70kb_post_then_the_start_of_the_next_request_is_answered_and_so_is_the_next() -> None:
    async def main() -> None:
        async with serving() as (stack, addr):
            raw = b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: 70000\r\n\r\n" + b"a" * 70000
            out, state = await talk(addr, raw + b"GET /next HTTP/1.1\r\nHo", more=b"st: x\r\n\r\n", until=2)
            assert state == "open" and out.count(b"HTTP/1.1 200 ") == 2, out[:400]
            assert out.index(b"/big") < out.index(b"/next")
            await settled(stack)

    run(main())


def test_a_head_over_the_limit_is_still_431() -> None:
    async def main() -> None:
        async with serving(max_header_bytes=4096) as (stack, addr):
            raw = b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n" * 100   # 3 kB of small heads: fine
            raw += b"GET /big HTTP/1.1\r\nX-Big: " + b"b" * 8000 + b"\r\n\r\n"
            out, state = await talk(addr, raw, until=101)
            assert out.count(b"HTTP/1.1 200 ") == 100 and b"HTTP/1.1 431 " in out, out[-300:]
            assert state != "reset"
            await settled(stack)

    run(main())


# --- item 6: malformed framing gets a 400 the client can read --------------------------------------

CHUNKED = b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
MALFORMED = {
    "unknown coding": b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "huge chunk size": CHUNKED + b"ffffffffffffffffff\r\nhello\r\n0\r\n\r\n",
    "0x chunk size": CHUNKED + b"0x5\r\nhello\r\n0\r\n\r\n",
    "chunk longer than its size": CHUNKED + b"3\r\nhello\r\n0\r\n\r\n",
    "bare LF": CHUNKED + b"5\nhello\n0\n\n",
}


def test_malformed_chunked_bodies_get_a_400_and_a_clean_close() -> None:
    async def main() -> None:
        async with serving() as (stack, addr):
            for name, raw in MALFORMED.items():
                out, state = await talk(addr, raw)
                assert out.startswith(b"HTTP/1.1 400 "), (name, out[:200])
                assert state == "eof", (name, state)
                # pipelined behind a good request: the good one first, then the 400
                out, state = await talk(addr, b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n" + raw)
                assert out.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 400 " in out, (name, out[:400])
                assert state == "eof", (name, state)
            await settled(stack)

    run(main())


def test_a_431_is_readable_by_a_client_still_sending() -> None:
    """The head goes over the limit while the client keeps writing: it still reads the 431
    (a lingering close), not a reset."""
    async def main() -> None:
        async with serving(max_header_bytes=8192) as (stack, addr):
            head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 20000
            out, state = await talk(addr, head, more=b"c" * 200_000)
            assert out.startswith(b"HTTP/1.1 431 "), out[:200]
            assert state == "eof"
            await settled(stack)

    run(main())


# --- item 7: sniffing takes for a frame only what can be one ------------------------------------

TLS_CLIENT_HELLO = bytes.fromhex("16030100a5010000a10303") + bytes(32) + bytes.fromhex("000004c02bc02f0100")


def test_a_lowercase_method_or_a_tls_hello_on_the_plain_port_is_not_taken_for_a_frame() -> None:
    from numaserve.framing import FramingConfig

    async def main() -> None:
        async with serving(framing=FramingConfig(enabled=True)) as (stack, addr):
            out, state = await talk(addr, b"get / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert out.startswith(b"HTTP/1.1 400 ") and state == "eof", out[:200]
            out, state = await talk(addr, TLS_CLIENT_HELLO)
            assert (out == b"" or out.startswith(b"HTTP/1.1 400 ")) and state == "eof", out[:200]
            # a frame is still a frame
            from numaserve.framing import FrameDecoder, encode_frame, encode_request
            out, _ = await talk(addr, encode_frame(encode_request(1, "GET", "/f")),
                                done=lambda b: len(b) >= 4 and len(b) >= 4 + int.from_bytes(b[:4], "big"))
            (reply,) = FrameDecoder().feed(out)
            assert b"/f" in reply
            await settled(stack)

    run(main())
