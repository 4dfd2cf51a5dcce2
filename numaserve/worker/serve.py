"""uvicorn on the listener fd inherited from the supervisor.

Version-sensitive glue (checked against uvicorn 0.54): we subclass
``uvicorn.Server`` to (1) keep its signal handlers out — the worker's own
SIGTERM handler and the control channel decide when to stop, (2) learn when
it has started, and (3) drain: ``Server.servers`` (the asyncio/uvloop
``Server`` objects, closed to stop accepting) and ``Server.server_state.
connections`` (protocol objects whose ``shutdown()`` closes an idle
connection or marks a busy one to close after its response; websockets
are closed by ``close_websocket`` at the drain deadline instead).

uvicorn's httptools protocol enforces no header size limit and no timeout
until the headers are complete (measured: a 2 MB header line is accepted; a
connection that never sends a byte stays open forever), so the default
protocol is a small subclass that adds both: 431 past ``max_header_bytes``,
408 (or a silent close if nothing arrived) past ``read_timeout``.  It also
gives uvicorn's own 400 (unparsable request) and 503 (``limit_concurrency``)
the JSON error body of ``numaserve.errors_http``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any, Callable, Generator, Sequence

import uvicorn

from numaserve.errors_http import error_body, error_headers
from numaserve.worker.spec import WorkerSpec

__all__ = [
    "WorkerServer",
    "build_config",
    "close_websocket",
    "connection_limit_503",
    "guarded_httptools_protocol",
    "is_websocket",
    "loop_factory",
    "open_listener",
]


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """Event loop factory for ``spec.loop``: uvloop for auto/uvloop when importable."""
    if name in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if name == "uvloop":
                raise
            return None
        return uvloop.new_event_loop
    if name in ("asyncio", "none", ""):
        return None
    raise ValueError(f"unknown loop {name!r}: expected auto, uvloop or asyncio")


def open_listener(fd: int) -> socket.socket:
    """Wrap the inherited listening fd.

    The supervisor holds its own descriptor for the same socket, so closing
    ours (uvicorn does on shutdown) never closes the listener or drops its
    accept queue.  Ours is made close-on-exec so subprocesses the app starts
    do not pin it.  Note that asyncio/uvloop set O_NONBLOCK, which is shared
    with the supervisor's descriptor (harmless: it never accepts).
    """
    sock = socket.socket(fileno=fd)
    try:
        if sock.type != socket.SOCK_STREAM:
            raise OSError(f"fd {fd} is not a stream socket")
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise OSError(f"fd {fd} is not listening")
        sock.set_inheritable(False)
    except BaseException:
        sock.detach()  # not ours to close on error: leave the fd as it was
        raise
    return sock


async def connection_limit_503(scope: Any, receive: Any, send: Any) -> None:
    """The answer past ``server.max_connections``: uvicorn's 503, in the error shape."""
    body = error_body(503, "server.max_connections reached: try again")
    await send({"type": "http.response.start", "status": 503,
                "headers": [*error_headers(503, body), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def guarded_httptools_protocol(max_header_bytes: int, header_timeout: float) -> type[asyncio.Protocol]:
    """The httptools protocol with a header size limit and a header timeout."""
    from uvicorn.protocols.http.flow_control import service_unavailable
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

    class _HeaderTooLarge(Exception):
        pass

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        """HttpToolsProtocol + 431 for huge headers + 408 for slow headers.

        Header size is counted two ways: exactly from the URL/header callbacks
        (catches a huge header block that arrives in one read), and from raw
        bytes received while the headers are still incomplete (catches one
        endless header line before httptools finishes buffering it; exact up
        to one read chunk).
        """

        _max_header_bytes = max_header_bytes
        _header_timeout = header_timeout

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_headers = True
            self._header_bytes = 0      # exact, from callbacks
            self._raw_header_bytes = 0  # received while headers incomplete
            self._too_large = False
            self._header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing() or not self._in_headers:
                return
            self._raw_header_bytes += len(data)
            if self._max_header_bytes and self._raw_header_bytes > self._max_header_bytes:
                self._reject(431, self._too_large_message())
                return
            if self._header_timer is None:
                self._arm_header_timer()

        def send_400_response(self, msg: str) -> None:
            if self._too_large:  # our callback stopped the parser: say why
                self._reject(431, self._too_large_message())
            else:  # uvicorn's own 400 ("Invalid HTTP request received."), in our error shape
                self._reject(400, msg, log=False)  # uvicorn already logged it

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            if app is service_unavailable:  # server.max_connections reached: uvicorn's text 503
                app = connection_limit_503
            super()._start_asgi_task(cycle, app)

        def _too_large_message(self) -> str:
            return f"request header fields too large: over server.max_header_bytes ({self._max_header_bytes} bytes)"

        def _count(self, n: int) -> None:
            self._header_bytes += n
            if self._max_header_bytes and self._header_bytes > self._max_header_bytes:
                self._too_large = True
                raise _HeaderTooLarge  # httptools turns it into HttpParserCallbackError -> 400 path

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers = True
            self._header_bytes = 0
            self._raw_header_bytes = 0

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            self._count(len(url))

        def on_header(self, name: bytes, value: bytes) -> None:
            super().on_header(name, value)
            self._count(len(name) + len(value) + 4)

        def on_headers_complete(self) -> None:
            self._in_headers = False
            self._cancel_header_timer()
            super().on_headers_complete()

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

        def _reject(self, status: int, msg: str, log: bool = True) -> None:
            self._cancel_header_timer()
            if self._busy():
                self.transport.close()  # cannot interleave a status into a running response
                return
            body = error_body(status, msg)
            content = [STATUS_LINE[status]]
            for name, value in [*self.server_state.default_headers, *error_headers(status, body),
                                (b"connection", b"close")]:
                content.extend([name, b": ", value, b"\r\n"])
            content.extend([b"\r\n", body])
            if log:
                self.logger.warning("%s: %d", msg, status)
            self.transport.write(b"".join(content))
            self.transport.close()

    return GuardedHttpToolsProtocol


def _http_protocol(spec: WorkerSpec) -> Any:
    if spec.http in ("auto", "httptools"):
        try:
            import httptools
        except ImportError:
            if spec.http == "httptools":
                raise
            return "h11"
        return guarded_httptools_protocol(spec.max_header_bytes, spec.read_timeout)
    return spec.http  # "h11": h11's own max_incomplete_event_size applies


SO_INCOMING_CPU = getattr(socket, "SO_INCOMING_CPU", 49)


def with_locality(protocol: Any, stats: Any, node_cpus: Sequence[int]) -> Any:
    """Wrap an HTTP protocol class to count connections by receiving CPU.

    ``SO_INCOMING_CPU`` on an accepted socket is the CPU that processed its
    packets (the RX softirq): a connection is *local* when that CPU belongs
    to this worker's node.  This is what NUMA steering optimises; status and
    metrics report the share.
    """
    if isinstance(protocol, str):
        from uvicorn.protocols.http.h11_impl import H11Protocol

        protocol = H11Protocol
    local = frozenset(node_cpus)

    class LocalityCounting(protocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            sock = transport.get_extra_info("socket")
            cpu = None
            if sock is not None:
                try:
                    cpu = sock.getsockopt(socket.SOL_SOCKET, SO_INCOMING_CPU)
                except OSError:
                    cpu = None
            stats.connection_accepted(None if cpu is None or not local else cpu in local)
            super().connection_made(transport)

    LocalityCounting.__name__ = f"LocalityCounting{protocol.__name__}"
    return LocalityCounting


def build_config(spec: WorkerSpec, app: Any, *, stats: Any = None, admission: Any = None) -> uvicorn.Config:
    """The uvicorn Config for this worker (logging left to us: ``log_config=None``).

    ``admission``: an ``AdmissionRuntime`` deciding admission in the HTTP
    protocol at head-complete (httptools only; h11 is decided by the middleware).
    """
    http = _http_protocol(spec)
    if admission is not None and not isinstance(http, str):
        from numaserve.worker.shedding import admission_protocol

        http = admission_protocol(http, admission)
    if spec.framing.enabled:  # frames and HTTP on the same port (numaserve.worker.sniff)
        from numaserve.worker.sniff import sniffing_protocol

        http = sniffing_protocol(http, spec.framing, read_timeout=spec.read_timeout)
    if stats is not None:
        http = with_locality(http, stats, spec.node_cpus)
    tls: dict[str, Any] = {}
    if spec.tls.enabled:  # context built here, in each new worker: reload picks up renewed files
        from numaserve.worker.tls import ssl_context_factory

        tls = {"ssl_context_factory": ssl_context_factory(spec.tls)}
    return uvicorn.Config(
        app,
        **tls,
        lifespan="auto",
        http=http,
        loop="none",  # we run the loop ourselves
        timeout_keep_alive=spec.keepalive_timeout,  # type: ignore[arg-type]  # float works
        timeout_graceful_shutdown=spec.graceful_timeout,  # type: ignore[arg-type]
        h11_max_incomplete_event_size=spec.max_header_bytes,
        limit_concurrency=spec.max_connections or None,
        access_log=spec.access_log,
        log_config=None,
        server_header=False,
        date_header=True,
    )


def is_websocket(conn: Any) -> bool:
    """True for uvicorn's websocket protocol objects (any implementation)."""
    return any(c.__module__.startswith("uvicorn.protocols.websockets") for c in type(conn).__mro__)


def close_websocket(conn: Any, code: int, reason: str) -> None:
    """uvicorn's websocket ``shutdown()`` with our close code instead of its fixed 1012.

    Knows the two implementations uvicorn picks by default (websockets'
    sans-I/O protocol, wsproto); anything else (the legacy ``websockets``
    implementation, chosen only explicitly) gets uvicorn's ``shutdown()``.
    """
    kind = type(conn).__name__
    if kind not in ("WebSocketsSansIOProtocol", "WSProtocol") or conn.close_sent \
            or not conn.handshake_complete:
        conn.shutdown()  # closing already, or still in the handshake (answered 500)
        return
    conn.stop_keepalive()
    conn.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
    if kind == "WSProtocol":
        import wsproto.events

        conn.transport.write(conn.conn.send(wsproto.events.CloseConnection(code=code, reason=reason)))
    else:
        conn.conn.send_close(code, reason)
        conn.transport.write(b"".join(conn.conn.data_to_send()))
    conn.close_sent = True
    conn.transport.close()


class WorkerServer(uvicorn.Server):
    """uvicorn.Server without signal handling, with a started hook and drain helpers."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._on_started = on_started

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn >= 0.29 installs SIGINT/SIGTERM handlers here; we do not want them."""
        yield

    def install_signal_handlers(self) -> None:
        """Same for uvicorn < 0.29."""

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self._on_started is not None:
            self._on_started()

    def adopt(self, sock: socket.socket) -> None:
        """Serve a connection accepted elsewhere (the admission sentinel); call on the loop."""
        config = self.config

        def create_protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state)

        task = asyncio.get_running_loop().create_task(
            asyncio.get_running_loop().connect_accepted_socket(create_protocol, sock))
        task.add_done_callback(lambda t: t.cancelled() or t.exception() and sock.close())

    def stop_accepting(self) -> int:
        """Close our listening server(s): our fd only, the supervisor's stays open."""
        servers = getattr(self, "servers", None) or []
        for srv in servers:
            srv.close()
        return len(servers)

    def shutdown_connections(self) -> int:
        """Close idle HTTP/frame connections now; busy ones close after their current response.

        WebSockets are left open: like a streaming response they get the
        whole drain deadline (``close_websockets`` at the end of it), where
        uvicorn's own ``shutdown()`` would close them with 1012 at once.
        """
        conns = [c for c in self.server_state.connections if not is_websocket(c)]
        for conn in conns:
            conn.shutdown()
        return len(conns)

    def close_websockets(self, code: int = 1001, reason: str = "server shutting down") -> int:
        """Close every open websocket now with ``code`` (1001 going away); returns how many.

        The app's pending ``receive()`` gets ``websocket.disconnect`` with
        that code and the client a Close frame with it.
        """
        conns = [c for c in self.server_state.connections if is_websocket(c)]
        for conn in conns:
            close_websocket(conn, code, reason)
        return len(conns)

    @property
    def connection_count(self) -> int:
        return len(self.server_state.connections)

    @property
    def websocket_count(self) -> int:
        return sum(1 for c in self.server_state.connections if is_websocket(c))
