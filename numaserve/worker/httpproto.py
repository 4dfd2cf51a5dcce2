"""The worker's HTTP/1.1 protocol: uvicorn's httptools protocol, guarded and lean, in one class.

Version-sensitive glue (checked against uvicorn 0.54, httptools 0.6-0.9).
``HttpToolsProtocol`` is kept for everything per connection (flow control,
pipelining, websocket upgrade, shutdown, ``server_state`` bookkeeping); the
per-request callbacks are replaced by one class instead of a stack of
subclasses, each calling ``super()``:

* **limits** — uvicorn enforces no header size limit and no timeout until
  the headers are complete (a 2 MB header line is accepted; a connection
  that never sends a byte stays open forever): 431 past
  ``max_header_bytes`` (counted from raw bytes while the head is
  incomplete, which catches one endless header line, and exactly at
  head-complete when one read was big enough to hold an oversized head),
  408 (or a silent close if nothing arrived) past ``read_timeout``;
* **admission** — with the "cpu" limiter (``numaserve.worker.shedding``)
  the request is decided when its head is complete, before any task
  exists: a refused request costs no task, no ASGI call and is answered
  (503/429/504 + Retry-After + ``x-numaserve-refusal``, ``numaserve.
  refusals``) in the same loop iteration its bytes were read.  A refused
  request whose body is in that read (a GET, a small POST) keeps its
  connection (cheap refusals: the client's next request needs no new TCP
  connection); it closes when the body is not in, the client or HTTP/1.0
  closes, the worker drains, ``admission.close_when_overloaded`` says so
  while shedding, or the client does not read its answers.  When the loop
  was late, ``TCP_INFO`` back-dates the arrival and a ``CLOSE_WAIT`` client
  is not run at all;
* **errors** — uvicorn's own 400 and the ``max_connections`` 503 get the
  JSON body of ``numaserve.errors_http``;
* **cost** — ``LeanCycle`` writes a response whose length is declared in
  ONE ``write`` (head and body; uvicorn makes two syscalls), validates
  header bytes once per distinct header (a bounded cache) instead of two
  regex scans per header per response, creates the request's
  ``asyncio.Event`` only when the app waits for the body, and the
  keep-alive timeout is one timer per connection re-armed lazily instead
  of a ``call_later`` per response and a cancel per read;
* **the edge, folded** — for a request whose body is already in (every
  GET, every small POST read with its head) ``LeanCycle.run_asgi`` does the
  worker ``Edge``'s per-request work itself, with the edge's own accounting
  object (``numaserve.worker.requestacct.RequestAcct``: counting, the admission
  permit, the departed client, ``Connection: close`` while draining, the
  outcome) and calls the app behind
  the edge with the cycle's own ``send``/``receive``: one coroutine and no
  wrapper per request or SSE chunk.  The rest (bodies still arriving, deadlines,
  other limiters, proxy headers) runs through the ``Edge``.
"""

from __future__ import annotations

import asyncio
import contextvars
import urllib.parse
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, service_unavailable
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from numaserve.errors_http import error_body, error_headers
from numaserve.loops.cpu_gate import CpuPermit
from numaserve.refusals import refusal_header
from numaserve.worker.shedding import (
    DEADLINE_HEADER,
    PERMIT_KEY,
    TCP_ESTABLISHED,
    AdmissionRuntime,
    reject_response,
    request_deadline,
    tcp_wait_and_state,
)
from numaserve.worker.requestacct import RequestAcct
from numaserve.worker.sniff import FrameSettings, first_read

__all__ = ["GuardedHttpToolsProtocol", "LeanCycle", "ProtocolSettings", "connection_limit_503"]

#: (name, value) header pairs already checked for forbidden bytes; cleared when full.
_VALID: set[tuple[bytes, bytes]] = set()
_VALID_MAX = 4096
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CHUNK_END = b"0\r\n\r\n"
#: After an error answer and FIN, what the client still sends is read and dropped this long /
#: this many bytes before the close (``_answer_and_linger``).
LINGER_S = 2.0
LINGER_BYTES = 1024 * 1024


class _HeaderTooLarge(Exception):
    pass


class _Stop(Exception):
    """Raised from a parser callback to stop parsing: the request was answered or dropped."""


def _check_header(name: bytes, value: bytes) -> None:
    try:
        if (name, value) in _VALID:
            return
    except TypeError:  # bytearray & co: not hashable, check every time
        pass
    if HEADER_RE.search(name):
        raise RuntimeError("Invalid HTTP header name.")
    if HEADER_VALUE_RE.search(value):
        raise RuntimeError("Invalid HTTP header value.")
    if len(_VALID) >= _VALID_MAX:
        _VALID.clear()
    try:
        _VALID.add((name, value))
    except TypeError:
        pass


class LeanCycle(RequestResponseCycle, RequestAcct):
    """uvicorn's ``RequestResponseCycle`` (same ASGI semantics), cheaper per request.

    ``send_500_response`` is uvicorn's; ``run_asgi`` is uvicorn's unless the edge is folded
    in (below).  Every attribute is set in ``__init__``, in one order: class-level defaults
    (fewer stores) measured dearer, since reads that fall through to the class are not
    specialised (+2 % instructions per request).  ``edge``: the worker's ``Edge`` when its
    per-request work can be folded into this cycle (``run_asgi``); ``folded``: this request
    took that path, and the cycle's ``RequestAcct`` part accounts for it.
    """

    def __init__(self, proto: Any, scope: Any, keep_alive: bool, expect_100_continue: bool,
                 edge: Any = None) -> None:
        self.edge = edge
        self.folded = False
        self.permit = None   # (RequestAcct's: read by send for a stream on either path)
        self.grant = None    # the admission permit this request owns from head-complete (protocol's)
        self.scope = scope
        self.transport = proto.transport
        self.flow = proto.flow
        self.logger = proto.logger
        self.access_logger = proto.access_logger
        self.access_log = proto.access_log
        self.default_headers = proto.server_state.default_headers
        self.on_response = proto.on_response_complete
        self._event = None
        self._flag = False
        self.disconnected = False
        self.keep_alive = keep_alive
        self.waiting_for_100_continue = expect_100_continue
        self.body = bytearray()
        self.more_body = True
        self.response_started = False
        self.response_complete = False
        self.chunked_encoding = None
        self.expected_content_length = 0
        self._head = None

    async def run_asgi(self, app: Any) -> None:
        """uvicorn's ``run_asgi``; for the worker's ``Edge`` with the request complete, the edge's
        per-request work inline (one coroutine, no ``send``/``receive`` wrapper).

        Folded: the app behind the edge is called with this cycle's own ``send``/``receive``
        when the request's body (if any) is already in and within ``max_body_bytes`` (so the
        body limits have nothing left to do), and admission, if on, was decided by the
        protocol without a deadline.  The counting, the permit (released at the end, or at the
        first chunk of a stream), the queue delay, the departed-client check and
        ``Connection: close`` while draining are the edge's, done here.  Anything else (a body
        still arriving, a deadline, the other limiters, proxy headers wrapping the edge) runs
        through the ``Edge`` itself.
        """
        edge = self.edge
        if edge is None or app is not edge or self.more_body \
                or (edge.max_body_bytes > 0 and len(self.body) > edge.max_body_bytes):
            await RequestResponseCycle.run_asgi(self, app)
            return
        scope = self.scope
        cpu = edge.cpu
        permit = None
        if cpu is not None:
            permit = scope.get(PERMIT_KEY)
            if permit is None or permit.deadline is not None:
                await RequestResponseCycle.run_asgi(self, app)   # undecided, or a deadline: the edge's path
                return
            del scope[PERMIT_KEY]
        self.folded = True
        self.begin(edge)   # counted from here
        inner = edge.app
        try:
            if permit is not None and not self.hold(permit, self.t0, permit.conn):
                inner = _no_response   # waited so long its client left: not run
            try:
                result = await inner(scope, self.receive, self.send)
            except BaseException as exc:
                self.failed(exc)
                self.logger.error("Exception in ASGI application\n", exc_info=exc)
                if not self.response_started:
                    await self.send_500_response()
                else:
                    self.transport.close()
            else:
                if result is not None:
                    self.logger.error("ASGI callable should return None, but returned '%s'.", result)
                    self.transport.close()
                elif not self.response_started and not self.disconnected:
                    self.logger.error("ASGI callable returned without starting response.")
                    self.judge()   # what the app answered (nothing), not uvicorn's 500 below
                    await self.send_500_response()
                elif not self.response_complete and not self.disconnected:
                    self.logger.error("ASGI callable returned without completing response.")
                    self.transport.close()
        finally:
            self.finish()
            self.on_response = _noop

    @property
    def message_event(self) -> asyncio.Event:  # type: ignore[override]
        """uvicorn's per-request event, made on first use."""
        ev = self._event
        if ev is None:
            ev = self._event = asyncio.Event()
            if self._flag:
                ev.set()
        return ev

    def notify(self) -> None:
        """Body bytes, the end of the body, the end of the response or a disconnect."""
        self._flag = True
        ev = self._event
        if ev is not None:
            ev.set()

    async def receive(self) -> Any:
        if self.waiting_for_100_continue and not self.transport.is_closing():
            self.transport.write(_CONTINUE)
            self.waiting_for_100_continue = False
        if not self.disconnected and not self.response_complete:
            self.flow.resume_reading()
            if not self._flag:
                await self.message_event.wait()
            self._flag = False
            if self._event is not None:
                self._event.clear()
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        message = {"type": "http.request", "body": bytes(self.body), "more_body": self.more_body}
        self.body = bytearray()
        return message

    async def send(self, message: Any) -> None:
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if not self.response_started:
            if message["type"] != "http.response.start":
                raise RuntimeError(f"Expected ASGI message 'http.response.start', but got '{message['type']}'.")
            self.response_started = True
            self.waiting_for_100_continue = False
            status_code = message["status"]
            if self.folded and self.on_response_start(int(status_code)):
                self.keep_alive = False   # the edge's part: Connection: close while draining (or shedding)
            if self.access_log:
                self.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(self.scope),
                                        self.scope["method"], get_path_with_query_string(self.scope),
                                        self.scope["http_version"], status_code)
            content = [STATUS_LINE[status_code]]
            for name, value in self.default_headers:   # the server's own (date): trusted
                content.extend((name, b": ", value, b"\r\n"))
            has_close = False
            for name, value in message.get("headers", ()):
                try:
                    known = (name, value) in _VALID
                except TypeError:   # bytearray & co: not hashable, checked every time
                    known = False
                if not known:
                    _check_header(name, value)
                name = name.lower()
                if name == b"content-length" and self.chunked_encoding is None:
                    self.expected_content_length = int(value.decode())
                    self.chunked_encoding = False
                elif name == b"transfer-encoding" and value.lower() == b"chunked":
                    self.expected_content_length = 0
                    self.chunked_encoding = True
                elif name == b"connection":
                    if b"close" in [token.lower().strip() for token in value.split(b",")]:
                        self.keep_alive = False
                        has_close = True
                content.extend((name, b": ", value, b"\r\n"))
            if not self.keep_alive and not has_close:
                content.append(b"connection: close\r\n")
            head_request = self.scope["method"] == "HEAD"
            if self.chunked_encoding is None and not head_request and status_code not in (204, 304):
                self.chunked_encoding = True
                content.append(b"transfer-encoding: chunked\r\n")
            content.append(b"\r\n")
            head = b"".join(content)
            if self.chunked_encoding is False and self.expected_content_length > 0 and not head_request:
                self._head = head   # goes out with the first body bytes: one write per response
            else:
                self.transport.write(head)   # streams: the head at once (an SSE client waits for it)
        elif not self.response_complete:
            if message["type"] != "http.response.body":
                raise RuntimeError(f"Expected ASGI message 'http.response.body', but got '{message['type']}'.")
            body = message.get("body", b"")
            more_body = message.get("more_body", False)
            if self.scope["method"] == "HEAD":
                self.expected_content_length = 0
            elif self.chunked_encoding:
                if body:
                    if more_body:
                        self.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
                    else:
                        self.transport.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body))
                elif not more_body:
                    self.transport.write(_CHUNK_END)
            else:
                num_bytes = len(body)
                if num_bytes > self.expected_content_length:
                    raise RuntimeError("Response content longer than Content-Length")
                self.expected_content_length -= num_bytes
                head = self._head
                if head is not None:
                    if num_bytes:
                        self._head = None
                        self.transport.write(head + body)
                elif num_bytes:
                    self.transport.write(body)
            if more_body:
                if self.permit is not None:   # a stream: no permit between chunks
                    self.streaming()
            else:
                if self.expected_content_length != 0:
                    raise RuntimeError("Response content shorter than Content-Length")
                self.response_complete = True
                self.notify()
                if not self.keep_alive:
                    self.transport.close()
                self.on_response()
        else:
            raise RuntimeError(f"Unexpected ASGI message '{message['type']}' sent, after response already completed.")


def _noop() -> None:
    """The cycle's ``on_response`` once its request is over (uvicorn's ``lambda: None``)."""


async def _no_response(scope: Any, receive: Any, send: Any) -> None:
    """In place of the app for a request not run (its client left): uvicorn answers it as an
    app that returned without a response, as the edge does."""


async def connection_limit_503(scope: Any, receive: Any, send: Any) -> None:
    """The answer past ``server.max_connections``: uvicorn's 503, in the error shape."""
    body = error_body(503, "server.max_connections reached: try again")
    await send({"type": "http.response.start", "status": 503,
                "headers": [*error_headers(503, body), refusal_header("connections"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _foldable_edge(app: Any, rt: Any) -> Any:
    """The worker's ``Edge`` when ``LeanCycle`` can do its per-request work itself: uvicorn
    loaded it unwrapped (no proxy-headers or trace middleware around it), it counts requests,
    and its admission is the protocol's own "cpu" runtime or none."""
    if getattr(app, "protocol_foldable", False) and app.stats is not None and app.cpu is rt:
        return app
    return None


@dataclass(frozen=True, slots=True)
class ProtocolSettings:
    """What a worker's HTTP protocol is configured with, built once per worker.

    ``max_header_bytes`` (0: no limit) / ``header_timeout`` (s, 0: none): the 431 and 408
    limits; ``admission``: the ``AdmissionRuntime`` deciding admission at head-complete,
    or None; ``access_log``: the worker's access log (``AccessLogMiddleware``), which
    also writes the line of a request the protocol refused before any ASGI call;
    ``frames``: hand connections whose first byte starts a frame to a ``FrameProtocol``
    (``numaserve.worker.sniff``), or None (HTTP only).
    """

    max_header_bytes: int
    header_timeout: float
    admission: AdmissionRuntime | None = None
    access_log: Any = None
    frames: FrameSettings | None = None

    def __post_init__(self) -> None:
        if self.max_header_bytes < 0:
            raise ValueError(f"max_header_bytes must be >= 0, got {self.max_header_bytes}")
        if self.header_timeout < 0:
            raise ValueError(f"header_timeout must be >= 0, got {self.header_timeout}")



class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol + 431/408 limits + admission at head-complete + ``LeanCycle``.

    uvicorn makes one per connection from the class alone (``Config(http=cls)``): a worker
    serves ``GuardedHttpToolsProtocol.configured(settings)``, a subclass that only sets
    ``settings``.  The settings are copied to instance attributes once per connection
    (reads per request stay instance reads, as the closure variables were).
    """

    #: Set per worker by ``configured``; the default is no limits and no admission.
    settings: ClassVar[ProtocolSettings] = ProtocolSettings(0, 0.0)

    @classmethod
    def configured(cls, settings: ProtocolSettings) -> type[GuardedHttpToolsProtocol]:
        """This protocol class with ``settings``, for ``uvicorn.Config(http=...)``."""
        return type(cls.__name__, (cls,), {"settings": settings, "__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        s = self.settings
        rt = s.admission
        self._max_header_bytes = s.max_header_bytes   # (instance attributes: read per request)
        self._header_timeout = s.header_timeout
        self._rt = rt
        self._gate = rt.gate if rt is not None else None
        self._clock = rt.clock if rt is not None else None
        self._default_timeout = rt.s.request_timeout_s if rt is not None else 0.0
        self._fold = _foldable_edge(self.app, rt)
        self._access = s.access_log
        self._reset_context = bool(getattr(self.config, "reset_contextvars", False))
        self._task_done = self.tasks.discard
        self._in_headers = True
        self._exact_head = False    # this read may hold a head over the limit: count it exactly
        self._raw_header_bytes = 0  # of the current request's head, received while it is incomplete
        self._began = False         # a request began in the read being parsed
        self._too_large = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._idle_since: float | None = None
        self._ka_timer: asyncio.TimerHandle | None = None
        self._ns_reject: Any = None  # the gate's refusal of the current request, not answered yet
                                     # (kept while its body is parsed: answered in place at its end)
        self._ns_drop = False
        self._ns_deadline = False   # this request's head has an x-request-timeout
        self._grant: Any = None     # the permit admitted for the head being parsed (no cycle yet)
        self._owned: dict[Any, Any] = {}   # request task -> its permit (released when done)
        self.lost = False           # connection_lost ran (``numaserve.worker.permits``)
        self._current: Any = None   # the cycle whose task was started last ...
        self._current_task: Any = None   # ... and that task
        self._final: bytes | None = None   # an error answer waiting for the pipeline ahead of it
        self._linger_timer: asyncio.TimerHandle | None = None
        self._linger_left = 0       # bytes still read and dropped before a lingering close
        self._frames = s.frames
        self.sniffing = s.frames is not None   # the first byte is still to be read (``first_read``)
        self.blank_bytes = 0             # empty-line bytes before it

    # --- connection ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._cancel_header_timer()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if self._rt is not None:
            self._release_unstarted()
        if self._ka_timer is not None:
            self._ka_timer.cancel()
            self._ka_timer = None
        self.connections.discard(self)
        cycle = self.cycle
        if cycle is not None:
            if not cycle.response_complete:
                cycle.disconnected = True
            cycle.notify()
        if self.flow is not None:
            self.flow.resume_writing()
        if exc is None:
            self.transport.close()
        self.parser = None  # type: ignore[assignment]

    def frames_took_over(self) -> None:
        """A ``FrameProtocol`` has this connection now (``first_read``): no timer of ours is left."""
        self._cancel_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.sniffing:   # HTTP or frames? (once per connection)
            got = first_read(self, data, self._frames)
            if got is None:
                return
            data = got
        if self._ns_drop:   # answered and closing: the rest is not ours to parse
            if self._linger_timer is not None:
                self._linger_left -= len(data)
                if self._linger_left <= 0:
                    self.transport.close()
            return
        self._idle_since = None
        if self._max_header_bytes:
            self._exact_head = self._raw_header_bytes + len(data) > self._max_header_bytes
        self._began = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._grant is not None:   # admitted, then the head failed: no request to own it
                grant, self._grant = self._grant, None
                self._gate.release(self._clock(), grant, "bad_request")
            if self._ns_reject is not None or self._ns_drop:
                self._refused()
            elif self._too_large:  # our callback stopped the parser: say why
                self._reject(431, self._too_large_message())
            else:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self._reject(400, msg, log=False)
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._ns_reject is not None:   # refused, its body not all in this read: close as before
            self._refused()
            return
        if not self._in_headers or self.transport.is_closing():
            cycle = self.cycle
            if cycle is not None and cycle.response_complete and self._header_timer is None \
                    and self._idle_since is None and not self.transport.is_closing():
                self._arm_header_timer()   # the rest of an answered request's body: read_timeout
            return
        if self._began:   # this head began inside this read: what of the read is its own
            self._raw_header_bytes = self._head_bytes()   # (earlier requests' bytes are not)
        else:
            self._raw_header_bytes += len(data)
        if self._max_header_bytes and self._raw_header_bytes > self._max_header_bytes:
            self._reject(431, self._too_large_message())
            return
        if self._header_timer is None:
            self._arm_header_timer()

    def send_400_response(self, msg: str) -> None:
        self._reject(400, msg, log=False)

    # --- parser callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.url = b""
        self.expect_100_continue = False
        self.headers = []
        self.scope = {  # type: ignore[typeddict-item]
            "type": "http",
            "asgi": {"version": self.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1",
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,  # type: ignore[typeddict-item]
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
        }
        self._in_headers = True
        self._raw_header_bytes = 0
        self._began = True
        self._ns_deadline = False

    # on_url is uvicorn's own: the head is only counted exactly (below) when a read could
    # hold more than max_header_bytes of it; smaller reads cannot exceed the limit and a head
    # spread over reads is bounded by the raw count in data_received

    def on_header(self, name: bytes, value: bytes) -> None:
        """uvicorn's, noting an ``x-request-timeout`` (the admission hook reads the headers
        for a deadline only when one came)."""
        name = name.lower()
        if name == b"expect":
            if value.lower() == b"100-continue":
                self.expect_100_continue = True
        elif name == DEADLINE_HEADER:
            self._ns_deadline = True
        self.headers.append((name, value))

    def _head_bytes(self) -> int:
        """The current head's bytes parsed so far (request target and complete header
        lines; a header line still incomplete is counted with the next read, whole)."""
        n = len(self.url)
        for name, value in self.headers:
            n += len(name) + len(value) + 4
        return n

    def _check_head_size(self) -> None:
        if self._head_bytes() > self._max_header_bytes:
            self._too_large = True
            raise _HeaderTooLarge  # httptools turns it into HttpParserCallbackError

    def on_headers_complete(self) -> None:
        if self._exact_head:
            self._check_head_size()
        parser = self.parser
        upgrade = parser.should_upgrade()
        prev = self.cycle
        if self._rt is not None and not upgrade and (prev is None or prev.response_complete):
            # websockets are not gated here, nor a request pipelined behind a running one:
            # it is decided by the edge when it starts (a permit counts a runnable request;
            # a refusal then is answered in order, and the connection stays usable)
            self._admit()
            if self._ns_reject is not None:   # refused, answered once its body is in (cheap refusal)
                self._in_headers = False
                if self._header_timer is not None:
                    self._cancel_header_timer()
                return
        self._in_headers = False
        if self._header_timer is not None:
            self._cancel_header_timer()
        http_version = parser.get_http_version()
        scope = self.scope
        scope["method"] = parser.get_method().decode("ascii")
        if http_version != "1.1":
            scope["http_version"] = http_version
        if upgrade and self._should_upgrade():
            return
        parsed_url = httptools.parse_url(self.url)
        raw_path = parsed_url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        root_path = self.root_path
        scope["path"] = root_path + path if root_path else path
        scope["raw_path"] = root_path.encode("ascii") + raw_path if root_path else raw_path
        scope["query_string"] = parsed_url.query or b""
        limit = self.limit_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            app: Any = connection_limit_503
            self.logger.warning("Exceeded concurrency limit.")
            if self._gate is not None:
                self._gate.count_refusal("connections")
            permit = scope.pop(PERMIT_KEY, None)
            if permit is not None:   # admitted, but answered without the app: give it back
                self._grant = None
                self._gate.release(self._clock(), permit, "ignored")
        else:
            app = self.app
        existing = self.cycle
        self.cycle = LeanCycle(self, scope, http_version != "1.0" and parser.should_keep_alive(),
                               self.expect_100_continue, self._fold)
        self.cycle.grant, self._grant = self._grant, None   # the request owns its permit now
        if existing is None or existing.response_complete:
            self._start_asgi_task(self.cycle, app)
        else:  # pipelined: queued behind the running one
            self.flow.pause_reading()
            self.pipeline.appendleft((self.cycle, app))

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        """uvicorn 0.54's, without its per-call lookups: a task per request, in a fresh
        ``contextvars.Context`` with ``reset_contextvars`` (uvicorn's opt-in), registered in
        ``server_state.tasks`` until done."""
        if app is service_unavailable:
            app = connection_limit_503
        self._current = cycle
        if self._reset_context:
            task = self.loop.create_task(cycle.run_asgi(app), context=contextvars.Context())
        else:
            task = self.loop.create_task(cycle.run_asgi(app))
        self._current_task = task
        grant = cycle.grant
        if grant is None:
            task.add_done_callback(self._task_done)
        else:   # the task owns the permit now: released when it is done, however it ends
            grant.task = task
            self._owned[task] = grant
            task.add_done_callback(self._owned_task_done)
        self.tasks.add(task)

    def _owned_task_done(self, task: asyncio.Task[None]) -> None:
        """A request task ended: its permit is given back if the request did not (a task
        cancelled before it ran never reaches its ``finally``)."""
        self.tasks.discard(task)
        grant = self._owned.pop(task, None)
        if grant is not None and not grant.released:
            self._gate.release(self._clock(), grant, "dropped")
        if task is self._current_task:
            self._current_task = None   # an idle keep-alive connection holds no finished task
            if task.cancelled():
                self._close_unanswered()

    def _close_unanswered(self) -> None:
        """The running request's task was cancelled before its response ended: nothing will
        answer it, and the requests pipelined behind it would wait for it forever (and the
        worker's graceful stop with them: a hypothesis example, 11 pipelined requests and one
        cancel, held it past 20 s).  Close: the client sees the connection end, the queued
        requests' permits go back (``connection_lost``)."""
        cycle = self._current
        transport = self.transport
        if cycle is not None and not cycle.response_complete and not transport.is_closing():
            transport.close()

    def _release_unstarted(self) -> None:
        """The connection is gone: the permits of requests that never started (queued behind
        the running one, or a head admitted without a request yet) are given back."""
        now = self._clock()
        grant, self._grant = self._grant, None
        if grant is not None:
            self._gate.release(now, grant, "dropped")
        while self.pipeline:
            cycle, _app = self.pipeline.pop()
            grant = cycle.grant
            if grant is not None:
                cycle.grant = None
                if not grant.released:
                    self._gate.client_gone(now, grant)

    def on_body(self, body: bytes) -> None:
        if self._ns_reject is not None:   # the body of a refused request: dropped
            return
        if self.parser.should_upgrade() and self._should_upgrade():
            return
        cycle = self.cycle
        if cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.notify()

    def on_message_complete(self) -> None:
        if self._ns_reject is not None:   # a refused request's body is in: answer, keep the connection
            self._refused_in_place()
            return
        if self.parser.should_upgrade() and self._should_upgrade():
            return
        cycle = self.cycle
        if cycle.response_complete:   # the body of an answered request is in: idle now
            if self._header_timer is not None:
                self._cancel_header_timer()
                self._idle_since = self.loop.time()
                if self._ka_timer is None:
                    self._ka_timer = self.loop.call_later(self.timeout_keep_alive, self._keepalive_check)
            return
        cycle.more_body = False
        cycle.notify()

    def on_response_complete(self) -> None:
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        flow = self.flow
        if flow.read_paused:
            flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        if self._final is not None:   # the requests ahead of an error are answered: now it
            final, self._final = self._final, None
            self._answer_and_linger(final)
            return
        self._idle_since = self.loop.time()
        if self._ka_timer is None:
            self._ka_timer = self.loop.call_later(self.timeout_keep_alive, self._keepalive_check)

    def _keepalive_check(self) -> None:
        """Close a connection idle for ``timeout_keep_alive``; re-armed for the rest otherwise."""
        self._ka_timer = None
        since = self._idle_since
        if since is None or self.transport.is_closing():
            return  # a request is in progress: its completion re-arms
        left = since + self.timeout_keep_alive - self.loop.time()
        if left <= 0:
            self.transport.close()
        else:
            self._ka_timer = self.loop.call_later(left, self._keepalive_check)

    # --- admission ------------------------------------------------------------------------

    def _admit(self) -> None:
        rt = self._rt
        gate = self._gate
        now = self._clock()  # type: ignore[misc]   # the request's one clock read before it starts
        arrived = now
        if rt.loop_late(now):
            got = tcp_wait_and_state(self.transport.get_extra_info("socket"))
            if got is not None:
                if got[1] != TCP_ESTABLISHED:   # the client already gave up: do not run it
                    gate.client_gone(now)
                    self._ns_drop = True
                    raise _Stop
                arrived = now - got[0]
        default_timeout = self._default_timeout
        if self._ns_deadline:
            deadline = request_deadline(self.headers, arrived, default_timeout)
        else:
            deadline = arrived + default_timeout if default_timeout > 0 else None
        d = gate.admit(now, deadline, rt.runnable)
        if type(d) is not CpuPermit:
            self._ns_reject = d
            if not self._can_keep(now):
                raise _Stop
            return
        d.enqueued_at = arrived
        d.conn = self
        self._grant = d
        self.scope[PERMIT_KEY] = d  # type: ignore[literal-required]
        rt.admitted()

    def _can_keep(self, now: float) -> bool:
        """A refused request may be answered keeping its connection (once its body is in):
        the client asked to keep it (HTTP/1.1, no ``Connection: close``), the worker is not
        draining, nor shedding with ``close_when_overloaded``, and reads what it is sent."""
        parser = self.parser
        if parser.get_http_version() != "1.1" or not parser.should_keep_alive():
            return False
        fold = self._fold
        if fold is not None and fold.stats.draining:
            return False
        if self.flow.write_paused:   # the client does not read its answers: do not queue more
            return False
        return not (self._rt.s.close_when_overloaded and self._gate.shedding(now))

    def _refused(self) -> None:
        """Answer the gate's refusal and close (the body was not read, or the connection must close)."""
        rej, self._ns_reject = self._ns_reject, None
        self._ns_drop = True
        self._cancel_header_timer()
        if rej is not None:
            counts = self._rt.edge_rejected
            counts[rej.status] = counts.get(rej.status, 0) + 1
            answer = reject_response(rej)
            self._log_refusal(rej, answer)
            self._answer_and_linger(answer)
        else:
            self.transport.close()

    def _refused_in_place(self) -> None:
        """Answer the gate's refusal of a request whose body is all in, keeping the connection:
        the client's next request (pipelined in the same read, or later) is parsed and decided
        as any other.  Nothing runs ahead of it (the gate decides only then), so it is in order."""
        rej, self._ns_reject = self._ns_reject, None
        counts = self._rt.edge_rejected
        counts[rej.status] = counts.get(rej.status, 0) + 1
        if self.transport.is_closing():   # the client left meanwhile: nobody to answer
            return
        answer = reject_response(rej, close=False, head=self.parser.get_method() == b"HEAD")
        self._log_refusal(rej, answer)
        self.transport.write(answer)
        self._idle_since = self.loop.time()
        if self._ka_timer is None:
            self._ka_timer = self.loop.call_later(self.timeout_keep_alive, self._keepalive_check)

    def _log_refusal(self, rej: Any, answer: bytes) -> None:
        """The access line of a request refused before any ASGI call (the scope is completed
        from the parser for it: the refusal came before the protocol filled it in)."""
        access = self._access
        if access is None or not access.enabled():
            return
        scope = self.scope
        try:
            if "method" not in scope:
                scope["method"] = self.parser.get_method().decode("ascii")
                version = self.parser.get_http_version()
                if version != "1.1":
                    scope["http_version"] = version
                url = httptools.parse_url(self.url)
                scope["path"] = self.root_path + urllib.parse.unquote(url.path.decode("ascii"))
                scope["query_string"] = url.query or b""
        except Exception:   # a log line must never fail a refusal (a URL httptools will not parse)
            scope.setdefault("method", "-")
        head, _, body = answer.partition(b"\r\n\r\n")
        headers = [tuple(line.split(b": ", 1)) for line in head.split(b"\r\n")[1:]]
        access.log_answer(scope, rej.status, len(body), headers, 0.0)

    # --- limits ---------------------------------------------------------------------------

    def _too_large_message(self) -> str:
        return f"request header fields too large: over server.max_header_bytes ({self._max_header_bytes} bytes)"

    def _arm_header_timer(self) -> None:
        if self._header_timeout and self._header_timeout > 0:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(self._header_timeout, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _busy(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._busy():  # a pipelined request is still being answered: wait for it
            self._arm_header_timer()
            return
        if self._in_headers and self._raw_header_bytes > 0:
            self._reject(408, "request header not received within server.read_timeout "
                              f"({self._header_timeout:g} s)")
        elif self.cycle is None:
            self.transport.close()  # connected, never sent a byte
        elif not self._in_headers:
            self.transport.close()  # the rest of an answered request's body never came

    def _reject(self, status: int, msg: str, log: bool = True) -> None:
        """Answer a request the parser refused (400, 408, 431) and close, in order: a request
        whose body broke is not run (or, running, sees a disconnect), the requests pipelined
        ahead of it are answered first, and the close lingers so the client can read it."""
        self._cancel_header_timer()
        self._ns_drop = True     # nothing after the error is parsed
        if log:
            self.logger.warning("%s: %d", msg, status)
        body = error_body(status, msg)
        content = [STATUS_LINE[status]]
        for name, value in [*self.server_state.default_headers, *error_headers(status, body),
                            (b"connection", b"close")]:
            content.extend([name, b": ", value, b"\r\n"])
        content.extend([b"\r\n", body])
        answer = b"".join(content)
        cycle = self.cycle
        if cycle is not None and not self._in_headers and not cycle.response_complete:
            # the error is in this request's body
            if cycle is not self._current:    # queued behind others: it never runs
                self.pipeline = type(self.pipeline)(e for e in self.pipeline if e[0] is not cycle)
                grant, cycle.grant = cycle.grant, None
                if grant is not None and not grant.released:
                    self._gate.release(self._clock(), grant, "bad_request")
            elif cycle.response_started:      # cannot interleave a status into a response
                self.transport.close()
                return
            else:                             # running, nothing sent: it sees a disconnect
                cycle.disconnected = True
                cycle.notify()
                self._answer_and_linger(answer)
                return
        current = self._current
        if self.pipeline or (current is not None and not current.response_complete
                             and not current.disconnected):
            self._final = answer              # after the requests ahead of it
            return
        self._answer_and_linger(answer)

    def _answer_and_linger(self, answer: bytes) -> None:
        """Write ``answer``, end our side (FIN), read and drop what the client still sends
        for up to ``LINGER_S`` / ``LINGER_BYTES``, then close: closing with unread bytes
        would send a reset, which can destroy the answer before the client reads it."""
        self._ns_drop = True
        transport = self.transport
        if transport.is_closing():
            return
        transport.write(answer)
        if not transport.can_write_eof():   # TLS: no half-close, close after the write
            transport.close()
            return
        transport.write_eof()
        if self.flow.read_paused:
            self.flow.resume_reading()
        self._linger_left = LINGER_BYTES
        self._linger_timer = self.loop.call_later(LINGER_S, transport.close)
