"""ASGI wrappers around the served app: stats, drain header, body limits.

Order (outermost first): ``MetricsMiddleware`` -> ``BodyLimitMiddleware`` ->
app, so 413/408 answers are counted like any other response.  Only ``http``
scopes are touched; ``websocket`` passes straight through, ``lifespan`` passes
through with its startup-failure message recorded (uvicorn only logs it, the
worker needs it for ``Goodbye``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, MutableMapping

from numaserve.worker.appload import describe_exception
from numaserve.worker.stats import WorkerStats

__all__ = [
    "ASGIApp",
    "BodyLimitMiddleware",
    "LifespanRecord",
    "MetricsMiddleware",
    "simple_response",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_CLOSE = (b"connection", b"close")


async def simple_response(send: Send, status: int, body: bytes,
                          content_type: bytes = b"text/plain; charset=utf-8",
                          close: bool = True) -> None:
    """Send a complete small response; ``close`` makes uvicorn drop the connection after it."""
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append(_CLOSE)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


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


class _Refuse(Exception):
    """Raised out of the wrapped ``receive`` to abort the app with a status."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


class BodyLimitMiddleware:
    """413 for bodies over ``max_body_bytes``, 408 when a body is slower than ``read_timeout``.

    A declared Content-Length over the limit is refused before the app runs
    (and before uvicorn would send ``100 Continue``).  Chunked bodies are
    counted as they stream.  The read deadline runs from the start of the
    request to the last body chunk; waiting for ``http.disconnect`` after the
    body is complete is not limited.  Both answers close the connection.
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
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1  # the HTTP parser already rejects these
                if limit > 0 and declared > limit:
                    await self._refuse(send, _Refuse(413, b"Request body too large"))
                    return
                break

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout if self.read_timeout > 0 else None
        received = 0
        body_done = False
        started = False

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done or deadline is None:
                message = await receive()
            else:
                try:
                    async with asyncio.timeout_at(deadline):
                        message = await receive()
                except TimeoutError:
                    raise _Refuse(408, b"Request body not received in time") from None
            if message["type"] == "http.request" and not body_done:
                received += len(message.get("body", b""))
                if not message.get("more_body", False):
                    body_done = True
                if limit > 0 and received > limit:
                    raise _Refuse(413, b"Request body too large")
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _Refuse as refusal:
            if started:
                raise  # too late for a status: uvicorn closes the connection
            await self._refuse(send, refusal)

    async def _refuse(self, send: Send, refusal: _Refuse) -> None:
        if self.stats is not None:
            if refusal.status == 413:
                self.stats.rejected_body_too_large += 1
            else:
                self.stats.rejected_read_timeout += 1
        await simple_response(send, refusal.status, refusal.body)
