"""The admin endpoint's HTTP/1.1 server: h11 on an ``asyncio.Protocol``, in the supervisor's loop.

Why not uvicorn: the admin endpoint answers three small GETs (``/metrics``,
``/healthz``, ``/readyz``), but ``import uvicorn`` brings its CLI, config,
logging config, supervisors, multiprocessing and the email package into the
supervisor: ~2 MB of its private memory (issue 17 counts the whole tree's
PSS against gunicorn --preload's).  h11 is the parser uvicorn ran here
anyway (its ``H11Protocol``), so requests are parsed by the same strict code;
this module is only the glue: one connection, one request at a time
(pipelined requests wait for the previous response), keep-alive, a 400 for
what h11 rejects, and the admission and idle deadlines of ``ConnectionGuard``
(``numaserve.supervisor.admin``).

The app is a plain ASGI callable (``build_app``); the request body is read
and dropped (no admin route takes one).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import structlog

from numaserve.errors import NumaserveError

__all__ = ["AdminHTTPServer", "Guard", "load_h11"]

log = structlog.get_logger("numaserve.admin")

#: The largest request head (request line + headers) accepted: scrapes and probes are tiny.
MAX_HEAD_BYTES = 16 * 1024

App = Callable[[Mapping[str, Any], Callable[[], Awaitable[Mapping[str, Any]]],
                Callable[[Mapping[str, Any]], Awaitable[None]]], Awaitable[None]]


class Guard(Protocol):
    """What the server needs from ``ConnectionGuard``."""

    idle_timeout: float
    timed_out: int

    def admit(self, proto: Any) -> bool: ...

    def forget(self, proto: Any) -> None: ...


def load_h11() -> Any:
    """h11, imported when the endpoint starts; a clear error when it is missing."""
    try:
        import h11
    except ImportError as e:  # a dependency of numaserve (and uvicorn): a broken install
        raise NumaserveError(f"the admin endpoint needs the h11 package ({e}); "
                             "reinstall numaserve, or set [admin] bind = \"\" to disable the endpoint") from None
    return h11


class AdminConnection(asyncio.Protocol):
    """One admin connection: parse with h11, answer each request with the ASGI app, in order."""

    def __init__(self, server: AdminHTTPServer) -> None:
        self.server = server
        self.h11 = server.h11
        self.conn = self.h11.Connection(self.h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None   # the request being answered
        self._refused = False
        self._timer: asyncio.TimerHandle | None = None
        self._peer: Any = None
        self._sockname: Any = None

    # --- asyncio.Protocol -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self.server.guard.admit(self):
            self._refused = True
            transport.abort()  # closed at once: no fd is kept for it
            return
        self.server.connections.add(self)
        self._peer = transport.get_extra_info("peername")
        self._sockname = transport.get_extra_info("sockname")
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self.server.guard.forget(self)
        self.server.connections.discard(self)
        self._disarm()
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.conn.receive_data(data)
        except RuntimeError:  # data after the end of the stream h11 already saw
            self._close()
            return
        self._advance()

    def eof_received(self) -> bool:
        with contextlib.suppress(RuntimeError):
            self.conn.receive_data(b"")
        self._advance()
        # a client that half-closed after its request still gets the answer (then we close);
        # with nothing being answered, close our side too
        return self.task is not None

    # --- ConnectionGuard's view ---------------------------------------------------------

    def idle(self) -> bool:
        """No request being answered: between requests (or before the first)."""
        return self.task is None

    def close_idle(self) -> None:
        self._disarm()
        self._close()

    # --- the request cycle ----------------------------------------------------------------

    def _advance(self) -> None:
        """Take the next events from h11 until it needs data or waits for our response."""
        h11 = self.h11
        while self.task is None and self.transport is not None and not self.transport.is_closing():
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as e:
                self._bad_request(e)
                return
            if event is h11.PAUSED and self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
                self.conn.start_next_cycle()  # keep-alive: the next (maybe pipelined) request
                self._arm()  # its headers get the same deadline
                continue
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self._disarm()  # a request is being answered: its deadline is the app's business
                self.task = asyncio.get_running_loop().create_task(self._answer(event), name="admin-request")
                return
            if isinstance(event, h11.ConnectionClosed):
                self._close()
                return
            # Data / EndOfMessage of a request already answered (bodies are dropped)

    async def _answer(self, req: Any) -> None:
        h11 = self.h11
        try:
            await self.server.app(self._scope(req), self._receive, self._send)
            if self.conn.our_state is h11.SEND_RESPONSE:  # the app sent nothing: never leave it hanging
                await self._send({"type": "http.response.start", "status": 500,
                                  "headers": [(b"content-length", b"0")]})
            if self.conn.our_state is h11.SEND_BODY:
                await self._send({"type": "http.response.body", "body": b""})
        except asyncio.CancelledError:
            self._close()
            raise
        except Exception as e:  # noqa: BLE001 - the connection ends, the supervisor does not
            log.warning("admin_request_failed", error=repr(e))
            self._close()
            return
        finally:
            self.task = None
        self._next_cycle()

    def _next_cycle(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self.conn.our_state is not self.h11.DONE:
            self._close()  # MUST_CLOSE / ERROR: HTTP/1.0, "Connection: close", a broken request
            return
        self._arm()  # idle again (a body still arriving is dropped meanwhile)
        self._advance()

    def _scope(self, req: Any) -> dict[str, Any]:
        target = bytes(req.target)
        path, _, query = target.partition(b"?")
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": req.http_version.decode(),
            "method": req.method.decode("ascii", "replace"),
            "scheme": "http",
            "path": path.decode("latin-1"),
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": [(bytes(k), bytes(v)) for k, v in req.headers],
            "client": self._peer[:2] if isinstance(self._peer, tuple) else None,
            "server": self._sockname[:2] if isinstance(self._sockname, tuple) else None,
        }

    async def _receive(self) -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def _send(self, message: Mapping[str, Any]) -> None:
        h11 = self.h11
        if message["type"] == "http.response.start":
            headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
            self._write(h11.Response(status_code=int(message["status"]), headers=headers))
        elif message["type"] == "http.response.body":
            body = bytes(message.get("body", b""))
            if body:
                self._write(h11.Data(data=body))
            if not message.get("more_body", False):
                self._write(h11.EndOfMessage())

    def _write(self, event: Any) -> None:
        data = self.conn.send(event)
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _bad_request(self, e: Any) -> None:
        h11 = self.h11
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            status = getattr(e, "error_status_hint", 400) or 400
            body = f"bad request: {e}\n".encode()
            try:
                self._write(h11.Response(status_code=status, headers=[
                    (b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")]))
                self._write(h11.Data(data=body))
                self._write(h11.EndOfMessage())
            except h11.LocalProtocolError:
                pass
        self._close()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _arm(self) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(self.server.guard.idle_timeout, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self.idle() and self.transport is not None and not self.transport.is_closing():
            self.server.guard.timed_out += 1
            self.transport.close()


class AdminHTTPServer:
    """Serve ``app`` on an already listening socket until ``request_stop()``; run ``serve()`` as a task."""

    def __init__(self, app: App, guard: Guard, *, backlog: int, graceful_s: float = 2.0) -> None:
        self.app = app
        self.guard = guard
        self.backlog = backlog
        self.graceful_s = graceful_s
        self.h11 = load_h11()
        self.connections: set[AdminConnection] = set()
        self.started = False
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        # asyncio accepts up to `backlog` connections per readiness event before any protocol
        # (so the guard) runs: a small batch keeps one event from filling the fd table
        server = await loop.create_server(lambda: AdminConnection(self), sock=sock, backlog=self.backlog)
        self.started = True
        try:
            await self._stop.wait()
        finally:
            server.close()  # no new connections; in-flight answers finish (bounded), then all close
            busy = [c.task for c in self.connections if c.task is not None]
            if busy:
                with contextlib.suppress(BaseException):
                    await asyncio.wait(busy, timeout=self.graceful_s)
            for c in list(self.connections):
                if c.transport is not None:
                    c.transport.abort() if c.task is not None else c.transport.close()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(server.wait_closed(), 1.0)
