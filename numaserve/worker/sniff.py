"""One port, two protocols: HTTP (uvicorn) and the length-prefixed frames.

``SniffingProtocol.configured(SniffSettings(...))`` is a protocol class for
uvicorn's ``Config(http=...)``.  Each connection starts as a
``BufferedProtocol`` reading into its frame decoder's preallocated buffer.
The first byte decides (``numaserve.framing.looks_like_http``), after any
empty lines (CR/LF, RFC 9112 §2.2: HTTP, since no frame can start so):

* HTTP: the uvicorn HTTP protocol is created, given the transport, swapped in
  with ``transport.set_protocol()`` and fed the bytes already read.  Checked
  on asyncio and uvloop, plain TCP and TLS transports alike: both switch
  between buffered and plain protocols in place, and later reads go to the
  new protocol directly, so HTTP pays one copy of its first read only.
  So is any first byte that cannot start a frame within ``max_frame_bytes``
  (``numaserve.framing.could_start_frame``: a lowercase method, a TLS
  ClientHello on the plain port): HTTP answers it with a 400, as uvicorn does.
* frames: the connection stays here.  Every complete frame becomes an ASGI
  ``http`` request to ``config.loaded_app`` — the very stack uvicorn runs
  (metrics, admission, body limits, cache, app) — and is answered with one
  frame carrying the request's ``id``.  Requests run concurrently
  (pipelining, up to ``max_pipeline`` per connection; past that the
  connection stops reading until one finishes), replies go out as they are
  ready, in any order.

Connections register in uvicorn's ``server_state.connections`` and request
tasks in ``server_state.tasks``, so drain, graceful shutdown and
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

__all__ = ["COUNTERS", "SniffSettings", "SniffingProtocol", "frame_stats", "resolve_http_protocol"]

logger = logging.getLogger("numaserve.frames")

#: Per-process counters (the worker adds them to Stats ``extra``).
COUNTERS: dict[str, int] = {
    "frame_connections": 0,
    "frame_requests": 0,
    "frame_errors": 0,
    "sniffed_http": 0,
}

#: The first read of every connection lands in a per-thread scratch buffer
#: this big (asyncio's and uvloop's own read size), so HTTP sees the same
#: first chunk as without sniffing; a frame connection copies that one chunk
#: into its decoder, every later read goes straight into the decoder.
_FIRST_READ = 256 * 1024
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
        buf = _scratch.buf = memoryview(bytearray(_FIRST_READ))
    return buf
_DEADLINE_HEADER = b"x-request-timeout"
_CRLF = (0x0D, 0x0A)
#: Empty-line bytes accepted before the first request line; more closes the connection.
_MAX_BLANK = 1024


def frame_stats() -> dict[str, int]:
    """A copy of the frame counters, for Stats ``extra``."""
    return dict(COUNTERS)


def resolve_http_protocol(http: Any) -> type[asyncio.Protocol]:
    """uvicorn's protocol class for a ``Config(http=...)`` value."""
    if isinstance(http, str):
        if http == "h11":
            from uvicorn.protocols.http.h11_impl import H11Protocol

            return H11Protocol
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    return http  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class SniffSettings:
    """What a worker's sniffing protocol is configured with, built once per worker.

    ``http_protocol``: the uvicorn HTTP protocol class HTTP connections are handed to;
    ``framing``: the frame limits and timeouts; ``read_timeout`` (s, 0: none): the first
    byte and a partial frame must arrive within it.
    """

    http_protocol: type[asyncio.Protocol]
    framing: FramingConfig
    read_timeout: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.http_protocol, type):
            raise TypeError(f"http_protocol must be a protocol class, got {self.http_protocol!r}")
        if self.read_timeout < 0:
            raise ValueError(f"read_timeout must be >= 0, got {self.read_timeout}")



class SniffingProtocol(asyncio.BufferedProtocol):
    """Starts every connection; stays for frame connections (see module docstring).

    uvicorn makes one per connection from the class alone (``Config(http=cls)``): a worker
    serves ``SniffingProtocol.configured(settings)``, a subclass that only sets ``settings``.
    """

    #: Set per worker by ``configured``; the default serves no HTTP and cannot be used.
    settings: ClassVar[SniffSettings | None] = None

    @classmethod
    def configured(cls, settings: SniffSettings) -> type[SniffingProtocol]:
        """This protocol class with ``settings``, for ``uvicorn.Config(http=...)``; named
        after the HTTP protocol it hands to (``SniffingGuardedHttpToolsProtocol``)."""
        name = f"Sniffing{settings.http_protocol.__name__}"
        return type(name, (cls,), {"settings": settings, "__module__": cls.__module__, "__qualname__": name})

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any] | None = None,
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        s = self.settings
        if s is None:
            raise TypeError("SniffingProtocol is served configured: SniffingProtocol.configured(settings)")
        self._http_protocol = s.http_protocol
        self._framing = s.framing
        self._read_timeout = s.read_timeout
        self.config = config
        self.server_state = server_state
        self.app_state = app_state if app_state is not None else {}
        self.loop = _loop or asyncio.get_event_loop()
        self.transport: Any = None
        self._decoder: FrameDecoder | None = None  # made when the first byte says "frames"
        self._mode = ""          # "" sniffing, "frames"
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
        self._blank = 0             # empty-line bytes skipped before the first request
        self._lost = False
        self._lost_event: asyncio.Event | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind = ""
        self.server: Any = None
        self.client: Any = None
        self.scheme = "http"

    # --- transport callbacks ----------------------------------------------------

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        from uvicorn.protocols.utils import get_local_addr, get_remote_addr, is_ssl

        self.transport = transport
        self.server_state.connections.add(self)
        self.server = get_local_addr(transport)
        self.client = get_remote_addr(transport)
        self.scheme = "https" if is_ssl(transport) else "http"
        self._set_timer("first", self._read_timeout)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._decoder is None or self._mode == "linger":
            return _scratch_buffer()  # filled and consumed within this one read callback
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        if self._mode == "linger":
            self._discarded += nbytes
            if self._discarded > _LINGER_BYTES:
                self.transport.close()
            return
        if self._decoder is None:
            if nbytes <= 0 or self._mode:
                return
            first = _scratch_buffer()[:nbytes]
            if first[0] in _CRLF or self._blank:
                self._skip_blank_lines(bytes(first))
                return
            if looks_like_http(first[0]) or not could_start_frame(first[0], self._framing.max_frame_bytes):
                self._switch_to_http(bytes(first))
                return
            self._mode = "frames"
            COUNTERS["frame_connections"] += 1
            self._decoder = FrameDecoder(self._framing.max_frame_bytes)
            self._decoder.feed_into(first)
        else:
            self._decoder.buffer_updated(nbytes)
        self._process()

    def eof_received(self) -> bool | None:
        if self._decoder is None or self._mode == "linger":
            return None  # nothing sent, or the client finished after our error: close
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

    # --- HTTP -----------------------------------------------------------------------

    def _skip_blank_lines(self, data: bytes) -> None:
        """RFC 9112 §2.2: empty lines before a request line are ignored.

        A frame never starts with CR or LF (its length would be over
        MAX_FRAME_LIMIT), so these bytes mean HTTP; they are dropped here
        (h11 would refuse them; httptools skips them) and whatever follows
        goes to the HTTP protocol, which answers 400 if it is not HTTP.
        """
        rest = data.lstrip(b"\r\n")
        self._blank += len(data) - len(rest)
        if self._blank > _MAX_BLANK:
            self.transport.close()  # a stream of empty lines is not a request
        elif rest:
            self._switch_to_http(rest)

    def _switch_to_http(self, first: bytes) -> None:
        COUNTERS["sniffed_http"] += 1
        self._cancel_timer()
        self.server_state.connections.discard(self)
        proto = self._http_protocol(config=self.config, server_state=self.server_state,  # type: ignore[call-arg]
                         app_state=self.app_state, _loop=self.loop)
        proto.connection_made(self.transport)
        self._mode = "http"
        self.transport.set_protocol(proto)
        proto.data_received(first)

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
        elif kind == "first" and not self._mode:
            self.transport.close()  # connected, never sent a byte
        else:
            self._update_timer()
