"""One port, two protocols: HTTP (uvicorn) and the length-prefixed frames.

Every connection starts as the worker's HTTP protocol: uvicorn makes it, as
it would without frames.  While its first bytes are read, the protocol asks
``first_read`` what they are.  The first byte decides
(``numaserve.framing.looks_like_http``), after any empty lines (CR/LF, RFC
9112 §2.2: HTTP, since no frame can start so; they are dropped here, as h11
would refuse them):

* HTTP: the bytes go to the HTTP parser, and the connection never comes back
  here.  So is any first byte that cannot start a frame within
  ``max_frame_bytes`` (``numaserve.framing.could_start_frame``: a lowercase
  method, a TLS ClientHello on the plain port): HTTP answers it with a 400,
  as uvicorn does.  HTTP pays one byte test per connection and one flag test
  per read; an earlier design started every connection as the frame protocol
  and handed HTTP over, which cost a second protocol object, a second timer
  and the address look-ups twice per connection (8-12 % of a worker's CPU
  with a new connection per request).
* frames: a ``FrameProtocol`` takes the connection
  (``transport.set_protocol()``, checked on asyncio and uvloop, plain TCP and
  TLS alike: later reads go to the new protocol directly) and is fed the
  bytes already read.  Every complete frame becomes an ASGI ``http`` request
  to ``config.loaded_app`` — the very stack uvicorn runs (metrics, admission,
  body limits, cache, app) — and is answered with one frame carrying the
  request's ``id``.  Requests run concurrently (pipelining, up to
  ``max_pipeline`` per connection; past that the connection stops reading
  until one finishes), replies go out as they are ready, in any order.

A silent connection is closed after ``read_timeout`` by the HTTP protocol's
own header timer (``GuardedHttpToolsProtocol``) or by ``sniffing_h11``'s.
Frame connections register in uvicorn's ``server_state.connections`` and
request tasks in ``server_state.tasks``, so drain, graceful shutdown and
``limit_concurrency`` treat frames like HTTP.  Error classes: see
``numaserve.errors_http`` (400/408/413 close the connection once the
requests in flight have been answered).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any, ClassVar

from numaserve.errors_http import error_body, error_headers
from numaserve.framing import (
    DEFAULT_MAX_FRAME,
    HEADER,
    FrameDecoder,
    FrameError,
    FrameRequest,
    FramingConfig,
    could_start_frame,
    decode_request,
    encode_response,
    looks_like_http,
)
from numaserve.refusals import refusal_header

__all__ = ["COUNTERS", "FrameProtocol", "FrameSettings", "first_read", "frame_stats", "sniffing_h11"]

logger = logging.getLogger("numaserve.frames")

#: Per-process counters (the worker adds them to Stats ``extra``).
COUNTERS: dict[str, int] = {
    "frame_connections": 0,
    "frame_requests": 0,
    "frame_errors": 0,
    "sniffed_http": 0,
}

#: What a lingering connection reads and drops lands in a per-thread scratch buffer this big.
_SCRATCH = 256 * 1024
_scratch = threading.local()
#: After a protocol error the error frame is followed by FIN, then whatever
#: the client still sends is read and dropped for up to this long / this many
#: bytes before the close — closing with unread data would make the kernel
#: send RST and the client could lose the error frame.
_LINGER_S = 2.0
_LINGER_BYTES = 64 * 1024 * 1024
#: Request bytes (frame payloads) in flight per connection before it stops reading: pipelined
#: frames are bounded by bytes, not only by ``max_pipeline`` (64 x 1 MiB held 64 MiB each).
#: The first request in flight is always taken, whatever its size.
PIPELINE_BYTES = 4 * 1024 * 1024
#: The largest reply payload a frame carries: what ``numaserve.client`` accepts by default (or
#: ``max_frame_bytes`` if larger).  A response past it (a big or endless stream) is cut and
#: answered with an error frame; the app's ``send`` raises ``ReplyTooLarge``.
REPLY_LIMIT = DEFAULT_MAX_FRAME


class ReplyTooLarge(OSError):
    """Raised from a frame request's ``send`` once its response is over the reply limit (an
    ``OSError``: frameworks treat it like a client that went away and stop streaming)."""


def _scratch_buffer() -> memoryview:
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = memoryview(bytearray(_SCRATCH))
    return buf


_DEADLINE_HEADER = b"x-request-timeout"
_CRLF = (0x0D, 0x0A)
#: Empty-line bytes accepted before the first request line; more closes the connection.
_MAX_BLANK = 1024


def frame_stats() -> dict[str, int]:
    """A copy of the frame counters, for Stats ``extra``."""
    return dict(COUNTERS)


@dataclass(frozen=True, slots=True)
class FrameSettings:
    """The frame limits and timeouts of a worker, built once per worker.

    ``framing``: the ``[framing]`` section; ``read_timeout`` (s, 0: none): a partial frame
    must arrive within it (the first byte's is the HTTP protocol's).
    """

    framing: FramingConfig
    read_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.read_timeout < 0:
            raise ValueError(f"read_timeout must be >= 0, got {self.read_timeout}")


def first_read(proto: Any, data: bytes, settings: FrameSettings) -> bytes | None:
    """What of a connection's first bytes its HTTP protocol ``proto`` parses; None: nothing
    (only empty lines so far, or the connection is closed, or a ``FrameProtocol`` took it).

    Called by the HTTP protocol from ``data_received`` while ``proto.sniffing`` is true; clears
    it once the first byte past any empty lines decided.  ``proto.blank_bytes`` counts the empty-line
    bytes.  When frames take over, ``proto.frames_took_over()`` stops the HTTP protocol's timers.
    """
    if proto.blank_bytes or data[0] in _CRLF:
        rest = data.lstrip(b"\r\n")
        proto.blank_bytes += len(data) - len(rest)
        if proto.blank_bytes > _MAX_BLANK:
            proto.transport.close()  # a stream of empty lines is not a request
            return None
        if not rest:
            return None
        proto.sniffing = False   # what follows empty lines is HTTP (a frame cannot start so)
        COUNTERS["sniffed_http"] += 1
        return rest
    proto.sniffing = False
    if looks_like_http(data[0]) or not could_start_frame(data[0], settings.framing.max_frame_bytes):
        COUNTERS["sniffed_http"] += 1
        return data
    transport = proto.transport
    proto.server_state.connections.discard(proto)
    proto.frames_took_over()
    frames = FrameProtocol(proto.config, proto.server_state, proto.app_state, proto.loop, settings)
    transport.set_protocol(frames)
    frames.adopt(transport, data, proto.server, proto.client, proto.scheme)
    return None


def sniffing_h11(settings: FrameSettings) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol handing frame connections over (``first_read``), with the
    first-byte timer that h11 lacks (``GuardedHttpToolsProtocol`` has its header timer)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class SniffingH11Protocol(H11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.sniffing = True
            self.blank_bytes = 0
            self._first_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if settings.read_timeout > 0:
                self._first_timer = self.loop.call_later(settings.read_timeout, self._silent)

        def _silent(self) -> None:
            self._first_timer = None
            if self.sniffing and not self.transport.is_closing():
                self.transport.close()  # connected, never sent a byte

        def frames_took_over(self) -> None:
            if self._first_timer is not None:
                self._first_timer.cancel()
                self._first_timer = None

        def data_received(self, data: bytes) -> None:
            if self.sniffing:
                got = first_read(self, data, settings)
                if not self.sniffing:
                    self.frames_took_over()   # decided: the first-byte timer is done
                if got is None:
                    return
                data = got
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.frames_took_over()
            super().connection_lost(exc)

    return SniffingH11Protocol


class FrameProtocol(asyncio.BufferedProtocol):
    """A frame connection, from the moment its first byte said so (see module docstring).

    Made by ``first_read`` and given the transport with ``adopt``; registers in uvicorn's
    ``server_state`` like uvicorn's own protocols, which it stands beside (``shutdown``).
    """

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 loop: asyncio.AbstractEventLoop, settings: FrameSettings) -> None:
        self._framing = settings.framing
        self._read_timeout = settings.read_timeout
        self.config = config
        self.server_state = server_state
        self.app_state = app_state
        self.loop = loop
        self.transport: Any = None
        self._decoder = FrameDecoder(settings.framing.max_frame_bytes)
        self._mode = "frames"       # or "linger"
        self._inflight = 0
        self._inflight_bytes = 0    # payload bytes of the requests in flight
        self._sizes: dict[Any, int] = {}   # request task -> its payload bytes
        self._failed = False        # a protocol error was answered: the connection is done
        self._read_paused = False   # we paused the transport
        self._write_paused = False  # the transport asked us to stop writing
        self._closing = False       # no more requests: close when in-flight is 0
        self._linger = False        # protocol error: half-close and drain before closing
        self._eof = False           # the client half-closed: answer what we have, then close
        self._discarded = 0
        self._lost = False
        self._lost_event: asyncio.Event | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind = ""
        self.server: Any = None
        self.client: Any = None
        self.scheme = "http"

    def adopt(self, transport: Any, first: bytes, server: Any, client: Any, scheme: str) -> None:
        """Take the connection over with the bytes already read (the transport already
        delivers to this protocol): register, then serve the frames in ``first``."""
        self.transport = transport
        self.server_state.connections.add(self)
        self.server, self.client, self.scheme = server, client, scheme
        COUNTERS["frame_connections"] += 1
        self._decoder.feed_into(first)
        self._process()

    # --- transport callbacks ----------------------------------------------------

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        raise RuntimeError("FrameProtocol takes a connection over with adopt(), never from the start")

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._mode == "linger":
            return _scratch_buffer()  # filled and dropped within this one read callback
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self._mode == "linger":
            self._discarded += nbytes
            if self._discarded > _LINGER_BYTES:
                self.transport.close()
            return
        self._decoder.buffer_updated(nbytes)
        self._process()

    def eof_received(self) -> bool | None:
        if self._mode == "linger":
            return None  # the client finished after our error: close
        if self._decoder.pending:
            COUNTERS["frame_errors"] += 1  # truncated frame: nobody left to answer
        if self._inflight:
            self._eof = True
            return True  # keep the write side open for the replies (and buffered requests)
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._cancel_timer()
        self.server_state.connections.discard(self)
        if self._lost_event is not None:
            self._lost_event.set()

    def pause_writing(self) -> None:
        self._write_paused = True
        self._pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._maybe_resume()

    # --- uvicorn server hooks -----------------------------------------------------

    def shutdown(self) -> None:
        """Drain/stop: close now when idle, else after the requests in flight."""
        self._closing = True
        self._pause_reading()
        if self._inflight == 0 and self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # --- frames ---------------------------------------------------------------------

    def _process(self) -> None:
        decoder = self._decoder
        try:
            for payload in decoder.frames():
                if self._closing:
                    break
                if self._timer_kind == "partial":
                    self._cancel_timer()  # progress: the next frame gets its own read_timeout
                self._on_frame(payload)
                if self._closing:
                    break
                if self._inflight >= self._framing.max_pipeline or self._inflight_bytes >= PIPELINE_BYTES:
                    self._pause_reading()
                    break
        except FrameError as e:
            as_json = decoder.peek_payload_byte() == 0x7B
            self._fail(e.status, e.message, None, as_json)
            return
        self._update_timer()

    def _on_frame(self, payload: memoryview) -> None:
        try:
            req = decode_request(payload)
        except FrameError as e:
            self._fail(e.status, e.message, e.request_id, payload[:1] == b"{")
            return
        COUNTERS["frame_requests"] += 1
        self.server_state.total_requests += 1
        limit = self.config.limit_concurrency
        if limit is not None and len(self.server_state.tasks) >= limit:
            self._send_error(req.id, 503, "connection limit reached", req.json, reason="connections")
            return
        self._inflight += 1
        size = len(payload)
        self._inflight_bytes += size
        task = self.loop.create_task(self._run(req))
        self._sizes[task] = size
        self.server_state.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.server_state.tasks.discard(task)
        self._inflight -= 1
        self._inflight_bytes -= self._sizes.pop(task, 0)
        if not task.cancelled() and task.exception() is not None:
            logger.error("frame request failed", exc_info=task.exception())
        if not self._closing:
            self._maybe_resume()  # requests still buffered go next, also after EOF
        if (self._closing or self._eof) and self._inflight == 0:
            self._finish()
        elif not self._lost:
            self._update_timer()

    def _maybe_resume(self) -> None:
        if self._closing or self._write_paused or self._lost or not self._read_paused:
            return
        if self._inflight >= self._framing.max_pipeline or self._inflight_bytes >= PIPELINE_BYTES:
            return
        self._read_paused = False
        self._process()  # frames already buffered go first
        if not self._read_paused and not self._closing and not self._eof:
            self.transport.resume_reading()

    def _pause_reading(self) -> None:
        if not self._read_paused and self.transport is not None and not self.transport.is_closing():
            self._read_paused = True
            try:
                self.transport.pause_reading()
            except (RuntimeError, AttributeError):  # closing / not supported
                pass

    def _scope(self, req: FrameRequest) -> dict[str, Any]:
        path, _, query = req.path.partition("?")
        headers = [(k, v) for k, v in req.headers if k != b"content-length"]
        headers.append((b"content-length", str(len(req.body)).encode()))
        if req.timeout is not None and not any(k == _DEADLINE_HEADER for k, _ in headers):
            headers.append((_DEADLINE_HEADER, repr(float(req.timeout)).encode()))
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "method": req.method,
            "root_path": self.config.root_path,
            "path": urllib.parse.unquote(path),
            "raw_path": path.encode("utf-8", "surrogateescape"),
            "query_string": query.encode("utf-8", "surrogateescape"),
            "headers": headers,
            "state": self.app_state.copy(),
            "extensions": {"numaserve.frame": {"id": req.id}},
        }

    async def _run(self, req: FrameRequest) -> None:
        scope = self._scope(req)
        status = 0
        headers: list[tuple[bytes, bytes]] = []
        chunks: list[bytes] = []
        size = 0
        limit = max(REPLY_LIMIT, self._framing.max_frame_bytes)
        over = False
        body_sent = False
        complete = False

        async def receive() -> dict[str, Any]:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            if not complete and not self._lost and not over:
                if self._lost_event is None:
                    self._lost_event = asyncio.Event()
                await self._lost_event.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            nonlocal status, headers, complete, size, over
            if over:
                raise ReplyTooLarge(f"response over the frame reply limit ({limit} bytes)")
            kind = message["type"]
            if kind == "http.response.start":
                if status:
                    raise RuntimeError("response already started")
                status = int(message["status"])
                headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", ())]
            elif kind == "http.response.body":
                if not status or complete:
                    raise RuntimeError("response body without a start or after the end")
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limit:   # cut: the memory is given back, the app is stopped
                        over = True
                        chunks.clear()
                        raise ReplyTooLarge(f"response over the frame reply limit ({limit} bytes)")
                    chunks.append(bytes(chunk))
                if not message.get("more_body", False):
                    complete = True

        app = self.config.loaded_app
        timed_out = False
        too_large = (f"response body over the frame reply limit ({limit} bytes): "
                     "fetch it over HTTP")
        try:
            if req.timeout is not None:
                async with asyncio.timeout(req.timeout) as cm:
                    try:
                        await app(scope, receive, send)
                    finally:
                        timed_out = cm.expired()
            else:
                await app(scope, receive, send)
        except TimeoutError:
            if not timed_out:
                logger.error("Exception in ASGI application (frame)", exc_info=True)
                if not complete:
                    self._send_error(req.id, 500, "internal error", req.json)
                return
            if not complete:
                self._send_error(req.id, 504, "deadline passed while the request ran", req.json, reason="deadline")
                return
        except Exception:  # noqa: BLE001 - the app's bug is answered, not fatal
            if over:   # our own cut (the app let ReplyTooLarge out): answered, not a bug
                self._send_error(req.id, 500, too_large, req.json)
                return
            logger.error("Exception in ASGI application (frame)", exc_info=True)
            if not complete:
                self._send_error(req.id, 500, "internal error", req.json)
            return
        if over:
            self._send_error(req.id, 500, too_large, req.json)
            return
        if not complete:
            self._send_error(req.id, 500, "the app returned without a complete response", req.json)
            return
        body = b"" if req.method == "HEAD" else b"".join(chunks)
        self._write(encode_response(req.id, status, headers, body, as_json=req.json))
        if any(k.lower() == b"connection" and b"close" in v.lower() for k, v in headers):
            self._closing = True  # draining worker: finish what is in flight, then close
            self._pause_reading()

    # --- answers and errors -----------------------------------------------------------

    def _write(self, payload: bytes) -> None:
        if self._lost or self.transport.is_closing() or self._mode == "linger":
            return
        self.transport.writelines([HEADER.pack(len(payload)), payload])

    def _send_error(self, rid: Any, status: int, message: str, as_json: bool,
                    reason: str | None = None) -> None:
        """An error frame; ``reason``: a refusal's (``numaserve.refusals``), in its headers."""
        COUNTERS["frame_errors"] += 1
        body = error_body(status, message)
        headers = error_headers(status, body)
        if reason is not None:
            headers.append(refusal_header(reason))
        self._write(encode_response(rid, status, headers, body, as_json=as_json, error=message))

    def _fail(self, status: int, message: str, rid: Any, as_json: bool) -> None:
        """Protocol error: answer, stop reading, close once in-flight replies are out.
        Once per connection: what follows the first error in the same read is not parsed."""
        if self._failed:
            return
        self._failed = True
        logger.info("frame protocol error %d: %s", status, message)
        self._send_error(rid, status, message, as_json)
        self._closing = True
        self._linger = True
        self._cancel_timer()
        self._pause_reading()
        if self._inflight == 0:
            self._finish()

    def _finish(self) -> None:
        """Close a connection that has nothing in flight (half-close + drain after an error)."""
        t = self.transport
        if self._lost or t.is_closing():
            return
        if not (self._linger and t.can_write_eof()):
            t.close()
            return
        self._mode = "linger"
        t.write_eof()
        self._set_timer("linger", _LINGER_S)
        if self._read_paused:
            self._read_paused = False
            t.resume_reading()

    # --- timers -------------------------------------------------------------------------

    def _update_timer(self) -> None:
        if self._mode == "linger":
            return   # the linger timer stays: it ends the connection
        if self._closing:
            self._cancel_timer()
        elif self._decoder.pending:
            if self._timer_kind != "partial":  # from the first byte of the frame: no slow-loris reset
                self._set_timer("partial", self._read_timeout)
        elif self._inflight == 0:
            if self._timer_kind != "idle":
                self._set_timer("idle", self._framing.idle_timeout)
        else:
            self._cancel_timer()

    def _set_timer(self, kind: str, seconds: float) -> None:
        self._cancel_timer()
        if seconds and seconds > 0:
            self._timer_kind = kind
            self._timer = self.loop.call_later(seconds, self._on_timer)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_kind = ""

    def _on_timer(self) -> None:
        kind, self._timer, self._timer_kind = self._timer_kind, None, ""
        if self._lost or self.transport.is_closing():
            return
        if kind == "partial" and self._decoder.pending:
            self._fail(408, "frame not received in time", None, self._decoder.peek_payload_byte() == 0x7B)
        elif kind == "idle" and self._inflight == 0 and not self._decoder.pending:
            self.transport.close()
        elif kind == "linger":
            self.transport.close()
        else:
            self._update_timer()
