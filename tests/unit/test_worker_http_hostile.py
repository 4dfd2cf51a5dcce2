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


# --- item 8: frames are bounded --------------------------------------------------------------------

def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class PeakRss:
    """The process's (the worker's, served in-process) peak RSS over a block, sampled."""

    def __init__(self) -> None:
        self.base = rss()
        self.peak = self.base
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, rss())
            await asyncio.sleep(0.005)

    async def __aenter__(self) -> PeakRss:
        self._task = asyncio.ensure_future(self._sample())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._task is not None
        self._task.cancel()
        self.peak = max(self.peak, rss())

    @property
    def grew(self) -> int:
        return self.peak - self.base


MIB = 1 << 20


def frames_on(**kw: Any) -> Any:
    from numaserve.framing import FramingConfig
    return serving(framing=FramingConfig(enabled=True, **kw))


def test_a_length_prefix_alone_does_not_make_100_connections_hold_the_declared_size() -> None:
    async def main() -> None:
        async with frames_on(max_frame_bytes=MIB) as (stack, addr):
            loop = asyncio.get_running_loop()
            socks = []
            async with PeakRss() as mem:
                for _ in range(100):
                    s = socket.create_connection(addr)
                    s.setblocking(False)
                    await loop.sock_sendall(s, (MIB).to_bytes(4, "big") + b"{")
                    socks.append(s)
                await asyncio.sleep(0.3)
                for s in socks:   # the next read is where the buffer used to grow to 1 MiB
                    await loop.sock_sendall(s, b'"')
                await asyncio.sleep(0.5)
            for s in socks:
                s.close()
            assert mem.grew < 40 * MIB, mem.grew   # was +107 MiB
            await settled(stack)

    run(main())


def test_a_response_fetched_through_a_frame_is_capped_with_an_error_frame() -> None:
    from numaserve.framing import FrameDecoder, decode_response, encode_frame, encode_request
    from test_worker_permits import STREAMED

    async def main() -> None:
        async with frames_on() as (stack, addr):
            def one_reply(b: bytes) -> bool:
                return len(b) >= 4 and len(b) >= 4 + int.from_bytes(b[:4], "big")
            async with PeakRss() as mem:
                out, _ = await talk(addr, encode_frame(encode_request(7, "GET", "/stream?64")), done=one_reply)
            (payload,) = FrameDecoder().feed(out)
            reply = decode_response(payload)
            assert reply["status"] == 500 and "reply limit" in reply["error"], reply
            assert STREAMED[-1] <= 17   # the app was stopped at the cap, not run to 64 MiB
            assert mem.grew < 100 * MIB, mem.grew   # was +167-188 MiB
            await settled(stack)

    run(main())


def test_pipelined_frames_are_bounded_by_bytes() -> None:
    from numaserve.framing import FrameDecoder, encode_frame, encode_request

    async def main() -> None:
        async with frames_on(max_frame_bytes=2 * MIB) as (stack, addr):
            body = "b" * (MIB - 200)
            raw = b"".join(encode_frame(encode_request(i, "POST", "/hold", body=body)) for i in range(64))

            async def one() -> list[bytes]:
                out, _ = await talk(addr, raw, timeout=120,
                                    done=lambda b: len(FrameDecoder(16 * MIB).feed(b)) >= 64)
                return FrameDecoder(16 * MIB).feed(out)

            async with PeakRss() as mem:
                replies = await asyncio.gather(one(), one(), one())
            assert [len(r) for r in replies] == [64, 64, 64]
            assert mem.grew < 64 * MIB, mem.grew   # was +124 MiB here (+199 MiB in the issue); ~22 now
            await settled(stack)

    run(main())


def test_two_bad_frames_in_one_read_are_one_error_and_no_traceback(caplog: Any) -> None:
    async def main() -> None:
        async with frames_on(max_frame_bytes=MIB) as (stack, addr):
            with caplog.at_level("DEBUG"):
                out, state = await talk(addr, b"\x00\x00\x00\x02xx\x00\xff\xff\xff")
                out2, _ = await talk(addr, b"\x00\x00\x00\x02xx" * 2)
                await asyncio.sleep(0.2)
            assert out and out2 and state == "eof"
            assert not [r for r in caplog.records if r.exc_info or "Fatal error" in r.getMessage()]
            assert len([r for r in caplog.records if "frame protocol error" in r.getMessage()]) == 2
            await settled(stack)

    run(main())


# --- item 9: every connection state has a timer -----------------------------------------------------

def test_an_unread_body_then_a_byte_after_the_answer_is_under_read_timeout() -> None:
    async def main() -> None:
        async with serving(read_timeout=1.0) as (stack, addr):
            head = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
            s = socket.create_connection(addr)
            s.setblocking(False)
            loop = asyncio.get_running_loop()
            try:
                await loop.sock_sendall(s, head)
                out = await asyncio.wait_for(loop.sock_recv(s, 4096), 20)
                assert out.startswith(b"HTTP/1.1 200 ")
                await loop.sock_sendall(s, b"a")   # one byte of the body the app never read
                rest = await asyncio.wait_for(loop.sock_recv(s, 4096), 20)   # closed by read_timeout
                assert rest == b""
            finally:
                s.close()
            # the body completed after the answer: the connection is idle, and serves the next one
            out, state = await talk(addr, head + b"a" * 1000 + b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n", until=2)
            assert out.count(b"HTTP/1.1 200 ") == 2 and state == "open"
            await settled(stack)

    run(main())
