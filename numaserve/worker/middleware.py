"""ASGI wrappers around the served app: stats, drain header, body limits.

Order (outermost first): ``MetricsMiddleware`` -> ``BodyLimitMiddleware`` ->
app, so 413/408 answers are counted like any other response.  Only ``http``
scopes are touched; ``websocket`` passes straight through, ``lifespan`` passes
through with its startup-failure message recorded (uvicorn only logs it, the
worker needs it for ``Goodbye``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, MutableMapping

from numaserve.errors_http import error_body, error_headers
from numaserve.worker.appload import describe_exception
from numaserve.worker.stats import WorkerStats

__all__ = [
    "ASGIApp",
    "BodyLimitMiddleware",
    "LifespanRecord",
    "MetricsMiddleware",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_CLOSE = (b"connection", b"close")

logger = logging.getLogger("numaserve.edge")


class LifespanRecord:
    """What the app said during lifespan startup (read by the worker on failure)."""

    def __init__(self) -> None:
        self.startup_failed_message: str | None = None
        self.exception: str | None = None


class MetricsMiddleware:
    """Counts requests/in-flight/status classes/latency; adds ``Connection: close`` while draining.

    While ``stats.draining`` is set every response start gets ``connection:
    close``: uvicorn then closes that keep-alive connection after the response,
    so clients move to the other workers without an error.
    """

    def __init__(self, app: ASGIApp, stats: WorkerStats,
                 lifespan: LifespanRecord | None = None) -> None:
        self.app = app
        self.stats = stats
        self.lifespan = lifespan if lifespan is not None else LifespanRecord()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        stats = self.stats
        status = 0
        t0 = time.perf_counter()

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                if stats.draining:
                    headers = list(message.get("headers", ()))
                    if not any(k.lower() == b"connection" and b"close" in v.lower()
                               for k, v in headers):
                        headers.append(_CLOSE)
                    message = dict(message)
                    message["headers"] = headers
            await send(message)

        stats.request_started()
        try:
            await self.app(scope, receive, counting_send)
        except BaseException:
            if status == 0:
                status = 500  # uvicorn answers 500 when the app raises before responding
            raise
        finally:
            if status == 0:
                status = 500  # returned without a response: uvicorn sends 500 (or the client left)
            stats.request_finished(status, (time.perf_counter() - t0) * 1000.0)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        record = self.lifespan

        async def recording_send(message: Message) -> None:
            if message.get("type") == "lifespan.startup.failed":
                record.startup_failed_message = str(message.get("message") or "") or "no message"
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        except BaseException as e:
            record.exception = describe_exception(e)
            raise


#: After a 413 the rest of the body is read and dropped for up to this long /
#: this many bytes before the connection closes (nginx's lingering close):
#: closing with unread data makes the kernel send RST, and a client still
#: writing its body (httpx, requests) would lose the answer.
LINGER_S = 2.0
LINGER_BYTES = 64 * 1024 * 1024


def _disconnect() -> Message:
    return {"type": "http.disconnect"}


class BodyLimitMiddleware:
    """413 for bodies over ``max_body_bytes``, 408 when a body is slower than ``read_timeout``.

    Decided and answered here, at the edge, never by raising into the app
    (frameworks turn an exception from ``receive()`` into their own 500):

    * a declared Content-Length over the limit is refused before the app
      runs (and before uvicorn would send ``100 Continue``);
    * a streamed (chunked) body is counted as it arrives; the read deadline
      runs from the start of the request to the last body chunk (waiting for
      ``http.disconnect`` after the body is complete is not limited).

    When a limit is hit the edge sends the JSON error itself (connection
    closed, after a bounded lingering read of the rest of a too-large body),
    and the app's ``receive()`` returns ``http.disconnect`` — to the app it
    looks like a client that left, so it stops as it would then; whatever it
    sends or raises afterwards is dropped.  If the app had already started
    its response there is no status left to send: it sees the disconnect
    and uvicorn closes the connection when it returns.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, read_timeout: float,
                 stats: WorkerStats | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout
        self.stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        if limit > 0:
            declared = _declared_length(scope)
            if declared > limit:
                self._count(413)
                # a client waiting for 100 Continue sends nothing: no need to linger
                linger = None if _expects_continue(scope) or declared > LINGER_BYTES else receive
                await _answer(send, 413, _too_large(limit), linger)
                return

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout if self.read_timeout > 0 else None
        received = 0
        body_done = False
        started = False
        refused = 0  # the status the edge decided on (0: none)

        async def refuse(status: int, message: str) -> Message:
            nonlocal refused
            refused = status
            self._count(status)
            if started:
                logger.warning("%s after the response started: the connection is closed", message)
            else:
                await _answer(send, status, message, receive if status == 413 else None)
            return _disconnect()

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if refused:
                return _disconnect()
            if body_done or deadline is None:
                message = await receive()
            else:
                try:
                    async with asyncio.timeout_at(deadline):
                        message = await receive()
                except TimeoutError:
                    return await refuse(408, f"request body not received within server.read_timeout "
                                             f"({self.read_timeout:g} s)")
            if message["type"] == "http.request" and not body_done:
                received += len(message.get("body", b""))
                if not message.get("more_body", False):
                    body_done = True
                if limit > 0 and received > limit:
                    return await refuse(413, _too_large(limit))
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the edge answered (or gave up on) this exchange
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except Exception as e:
            if not refused:
                raise
            logger.debug("app raised after the edge answered %d: %s", refused, describe_exception(e))

    def _count(self, status: int) -> None:
        if self.stats is not None:
            if status == 413:
                self.stats.rejected_body_too_large += 1
            else:
                self.stats.rejected_read_timeout += 1


def _too_large(limit: int) -> str:
    return f"request body too large: over server.max_body_bytes ({limit} bytes)"


def _declared_length(scope: Scope) -> int:
    """The request's Content-Length, -1 when absent (the HTTP parser rejects bad ones)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return -1


def _expects_continue(scope: Scope) -> bool:
    return any(name == b"expect" and value.lower() == b"100-continue"
               for name, value in scope.get("headers", ()))


async def _answer(send: Send, status: int, message: str, linger: Receive | None) -> None:
    """The JSON error from the edge, closing the connection.

    With ``linger`` the complete body goes out first (``more_body`` still
    set, so the connection stays open), then the rest of the request body is
    read and dropped within LINGER_S / LINGER_BYTES, then the empty final
    chunk makes the server close.
    """
    body = error_body(status, message)
    await send({"type": "http.response.start", "status": status,
                "headers": [*error_headers(status, body), _CLOSE]})
    if linger is None:
        await send({"type": "http.response.body", "body": body, "more_body": False})
        return
    await send({"type": "http.response.body", "body": body, "more_body": True})
    await _discard_body(linger)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _discard_body(receive: Receive) -> None:
    dropped = 0
    try:
        async with asyncio.timeout(LINGER_S):
            while dropped <= LINGER_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return
                dropped += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return
    except TimeoutError:
        return
