"""uvicorn on the listener fd inherited from the supervisor.

Version-sensitive glue (checked against uvicorn 0.54): we subclass
``uvicorn.Server`` to (1) keep its signal handlers out — the worker's own
SIGTERM handler and the control channel decide when to stop, (2) learn when
it has started, and (3) drain: ``Server.servers`` (the asyncio/uvloop
``Server`` objects, closed to stop accepting) and ``Server.server_state.
connections`` (protocol objects whose ``shutdown()`` closes an idle
connection or marks a busy one to close after its response; websockets
are closed by ``close_websocket`` at the drain deadline instead).

The default HTTP protocol is ``numaserve.worker.httpproto`` (uvicorn's
httptools protocol with header limits, admission at head-complete and a
leaner request cycle, in one class, which hands a connection whose first
byte starts a frame to ``numaserve.worker.sniff``); ``build_config`` adds
locality counting around it.  The whole
worker is assembled in ``numaserve.worker.edge.build_stack``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any

import uvicorn

from numaserve.quietserver import QuietServerMixin
from numaserve.worker.httpproto import GuardedHttpToolsProtocol, ProtocolSettings, connection_limit_503
from numaserve.worker.sniff import FrameSettings, sniffing_h11
from numaserve.worker.spec import WorkerSpec

__all__ = [
    "WorkerServer",
    "build_config",
    "close_websocket",
    "connection_limit_503",
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


def _http_protocol(spec: WorkerSpec, admission: Any = None, access_log: Any = None) -> Any:
    """The protocol class (or uvicorn's name for one) every connection starts with; with
    ``[framing]`` on it hands frame connections over (``numaserve.worker.sniff``)."""
    frames = FrameSettings(spec.framing, spec.read_timeout) if spec.framing.enabled else None
    if spec.http in ("auto", "httptools"):
        try:
            import httptools  # noqa: F401
        except ImportError:
            if spec.http == "httptools":
                raise
        else:
            return GuardedHttpToolsProtocol.configured(
                ProtocolSettings(spec.max_header_bytes, spec.read_timeout, admission, access_log, frames))
    # "h11" (h11's own max_incomplete_event_size applies)
    return sniffing_h11(frames) if frames is not None else "h11"


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
    protocol at head-complete (httptools only; h11 is decided by the edge).
    """
    from numaserve.accesslog import AccessLogMiddleware

    # the access log also writes the lines of requests the protocol refuses before any ASGI call
    http = _http_protocol(spec, admission, app if isinstance(app, AccessLogMiddleware) else None)
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
        backlog=spec.server.backlog,  # uvicorn listen()s again with its own (2048) otherwise
        access_log=False,  # numaserve.accesslog writes the line once the response ended (build_stack)
        root_path=spec.server.root_path,
        # off unless configured: uvicorn's default trusts X-Forwarded-* from 127.0.0.1 and
        # pays a middleware per request for it (server.proxy_headers, forwarded_allow_ips)
        proxy_headers=spec.proxy_headers,
        forwarded_allow_ips=list(spec.forwarded_allow_ips),
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


class WorkerServer(QuietServerMixin, uvicorn.Server):
    """uvicorn.Server without signal handling (numaserve.quietserver: exit on an event, a once-a-second
    main loop; a drained worker goes at once), with a started hook and drain helpers."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None] | None = None) -> None:
        super().__init__(config)
        self._on_started = on_started

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, without its fixed 0.1 s wait when nothing is left to finish.

        The drain (``numaserve.worker.main``) already waited for every connection and
        request; with none left, the wait only delays the exit a roll is waiting for.
        """
        if self.server_state.connections or self.server_state.tasks:
            await super().shutdown(sockets=sockets)
            return
        logging.getLogger("uvicorn.error").info("Shutting down")
        for srv in getattr(self, "servers", None) or []:
            srv.close()
        for sock in sockets or []:
            sock.close()
        if not self.force_exit:
            await self.lifespan.shutdown()

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
