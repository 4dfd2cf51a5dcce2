"""The worker's edge: ONE ASGI layer for metrics, admission and body limits, and the assembly.

Every HTTP request of a worker passes through exactly one ``Edge`` (HTTP
parsed by uvicorn's protocol, frames from ``numaserve.worker.sniff`` and
h11 alike), with one ``send`` wrapper and, only when the request has a
body, one ``receive`` wrapper — or, for an HTTP/1 request whose body is
already in, the same work done by the protocol's request cycle
(``numaserve.worker.httpproto.LeanCycle.run_asgi``: no layer at all).  Both
paths do the per-request accounting through one ``numaserve.worker.
requestacct.RequestAcct`` (this layer's ``_Exchange`` is one).  Per request it:

* counts it (``WorkerStats``: in flight, status, latency — a few increments);
* finishes admission: the "cpu" limiter decided in the protocol at
  head-complete and left its permit in the scope (``numaserve.worker.
  shedding``); requests the protocol did not see (frames, h11) are decided
  here by the same gate.  A request whose client left while it waited is
  not run.  Deadlines (``x-request-timeout`` or the default) give 504 before
  the response starts.  The permit is released when the request ends, or
  when its response turns out to be a stream (its first body chunk has
  ``more_body``): a stream between two chunks uses no CPU and holds no
  permit (docs/admission.md);
* enforces ``server.max_body_bytes`` (413, after a bounded lingering read of
  the rest of the body so the client gets the answer, not an RST) and
  ``server.read_timeout`` for the body (408), answered here, never by
  raising into the app: the app's ``receive()`` returns ``http.disconnect``
  as if the client left;
* adds ``Connection: close`` to responses while the worker drains (and,
  with ``admission.close_when_overloaded``, while it sheds).

``build_stack`` assembles the whole worker: the ASGI chain (Edge -> cache ->
app) and the uvicorn config with the protocol chain (``numaserve.worker.
serve.build_config``: locality counting around the guarded httptools
protocol with the admission hook and the hand-over of frame connections).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from numaserve.errors_http import error_body, error_headers
from numaserve.loops.cpu_gate import CpuPermit
from numaserve.refusals import refusal_header
from numaserve.worker.appload import describe_exception
from numaserve.worker.asgi_types import ASGIApp, Message, Receive, Scope, Send
from numaserve.worker.requestacct import RequestAcct
from numaserve.worker.shedding import (
    CONN_KEY,
    PERMIT_KEY,
    request_deadline,
)
from numaserve.worker.stats import WorkerStats

__all__ = [
    "LINGER_BYTES",
    "LINGER_S",
    "Edge",
    "LifespanRecord",
    "Stack",
    "build_stack",
]

logger = logging.getLogger("numaserve.edge")

_CLOSE = (b"connection", b"close")

#: After a 413 the rest of the body is read and dropped for up to this long /
#: this many bytes before the connection closes (nginx's lingering close):
#: closing with unread data makes the kernel send RST, and a client still
#: writing its body (httpx, requests) would lose the answer.
LINGER_S = 2.0
LINGER_BYTES = 64 * 1024 * 1024


class LifespanRecord:
    """What the app said during lifespan startup (read by the worker on failure)."""

    def __init__(self) -> None:
        self.startup_failed_message: str | None = None
        self.exception: str | None = None


async def _done() -> None:
    return None


def _with_close(message: Message) -> Message:
    headers = list(message.get("headers", ()))
    if not any(k.lower() == b"connection" and b"close" in v.lower() for k, v in headers):
        headers.append(_CLOSE)
    out = dict(message)
    out["headers"] = headers
    return out


class _Exchange(RequestAcct):
    """One request's state at the edge: its accounting (``RequestAcct``: counted from here,
    ``finish`` at its end) and the body limits; ``send``/``receive`` are the only wrappers."""

    __slots__ = (
        "body_done",
        "raw_receive",
        "raw_send",
        "read_by",
        "read_deadline",
        "received",
        "refused",
        "started",
    )

    edge: Edge

    def __init__(self, edge: Edge, send: Send, receive: Receive) -> None:
        self.begin(edge)
        self.raw_send = send
        self.raw_receive = receive
        self.started = False
        self.refused = 0         # the status the edge answered instead of the app (0: none)
        self.received = 0
        self.body_done = False
        self.read_deadline: float | None = None   # loop time the body must be in by
        self.read_by: float | None = None         # the same on the edge's clock, until the app reads

    def send(self, message: Message) -> Awaitable[None]:
        """The app's ``send``: returns the server's own awaitable (no coroutine of its own: this
        runs per response start and per body chunk)."""
        if self.refused:
            return _done()  # the edge answered (or gave up on) this exchange
        if not self.started:
            if message["type"] == "http.response.start":
                self.started = True
                if self.on_response_start(int(message["status"])):
                    message = _with_close(message)
        elif self.permit is not None and message.get("more_body", False):
            self.streaming()
        return self.raw_send(message)

    async def receive(self) -> Message:
        if self.refused:
            return {"type": "http.disconnect"}
        deadline = self.read_deadline
        if deadline is None and self.read_by is not None:   # the app's first read: to loop time
            edge = self.edge
            deadline = self.read_deadline = asyncio.get_running_loop().time() + (self.read_by - edge.clock())
        if self.body_done or deadline is None:
            message = await self.raw_receive()
        else:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await self.raw_receive()
            except TimeoutError:
                return await self.refuse(408, "request body not received within server.read_timeout "
                                              f"({self.edge.read_timeout:g} s)")
        if message["type"] == "http.request" and not self.body_done:
            self.received += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.body_done = True
            limit = self.edge.max_body_bytes
            if limit > 0 and self.received > limit:
                return await self.refuse(413, _too_large(limit))
        return message

    async def refuse(self, status: int, message: str) -> Message:
        """A body limit hit: answer here (unless the app already started), the app sees a disconnect."""
        self.refused = status
        self.edge.count_refusal(status)
        if self.started:
            logger.warning("%s after the response started: the connection is closed", message)
        else:
            self.started = True
            self.status = status
            await answer(self.raw_send, status, message, self.raw_receive if status == 413 else None)
        return {"type": "http.disconnect"}

    async def answer(self, status: int, message: str, *, retry_after: int | None = None,
                     close: bool = False, reason: str | None = None) -> None:
        """An error the edge sends instead of the app (admission refusal, deadline); ``reason``:
        the refusal's, of ``numaserve.refusals`` (the ``x-numaserve-refusal`` header)."""
        self.started = True
        self.status = status
        body = error_body(status, message)
        headers = error_headers(status, body, retry_after or 1)
        if reason is not None:
            headers.append(refusal_header(reason))
        if close:
            headers.append(_CLOSE)
        await self.raw_send({"type": "http.response.start", "status": status, "headers": headers})
        await self.raw_send({"type": "http.response.body", "body": body, "more_body": False})


class Edge:
    """The one edge layer (see the module docstring).

    ``stats``: count requests (and close connections while draining);
    ``limit_stats``: where 413/408 refusals are counted (default ``stats``);
    ``cpu``: an ``AdmissionRuntime`` (the CPU gate; None: no admission); ``max_body_bytes`` /
    ``read_timeout``: the body limits (0: none).

    Served by the worker's HTTP protocol, a request with its body already in skips this
    layer's coroutine and wrapper: ``numaserve.worker.httpproto.LeanCycle.run_asgi`` does
    the same per-request work with the same ``RequestAcct`` (``protocol_foldable``).
    """

    #: ``LeanCycle`` may do this layer's per-request work itself (see above).
    protocol_foldable = True

    def __init__(self, app: ASGIApp, *, stats: WorkerStats | None = None, lifespan: LifespanRecord | None = None,
                 cpu: Any = None, default_timeout_s: float = 0.0,
                 max_body_bytes: int = 0, read_timeout: float = 0.0,
                 limit_stats: WorkerStats | None = None) -> None:
        self.app = app
        self.stats = stats
        self.lifespan = lifespan if lifespan is not None else LifespanRecord()
        self.cpu = cpu
        self.rt = cpu      # (the worker's name for it: sentinel start/stop, set_limits)
        self.gate = cpu.gate if cpu is not None else None
        if cpu is not None:
            default_timeout_s = cpu.s.request_timeout_s
        self.default_timeout_s = default_timeout_s
        self.close_when_overloaded = bool(cpu is not None and cpu.s.close_when_overloaded)
        self.gone_after = cpu.s.gone_check_after_s if cpu is not None else 0.0
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout
        self.limit_stats = limit_stats if limit_stats is not None else stats
        self.rejected: dict[int, int] = {}
        self.clock = cpu.clock if cpu is not None else time.monotonic   # request start, body deadline

    # --- the per-request pieces the exchange calls -----------------------------------------

    def count_refusal(self, status: int) -> None:
        stats = self.limit_stats
        if stats is not None:
            if status == 413:
                stats.rejected_body_too_large += 1
            else:
                stats.rejected_read_timeout += 1

    # --- ASGI -----------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            ex = _Exchange(self, send, receive)   # counted from here, two clock reads per request
            try:
                await self._http(scope, ex)
            finally:
                ex.finish()
        elif kind == "lifespan":
            await self._lifespan(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _http(self, scope: Scope, ex: _Exchange) -> None:
        """Admission finished (limiter "cpu": decided here for frames and h11), then the app.
        The permit is left in ``ex`` for ``__call__`` to release (``ex.finish``)."""
        now = ex.t0
        deadline: float | None = None
        permit = None
        cpu = self.cpu
        if cpu is not None:
            gate = self.gate
            permit = scope.pop(PERMIT_KEY, None)
            if permit is None:  # not decided at the protocol (frames, h11)
                d = gate.admit(now, request_deadline(scope["headers"], now, self.default_timeout_s),
                               cpu.runnable)
                if type(d) is not CpuPermit:
                    self.rejected[d.status] = self.rejected.get(d.status, 0) + 1
                    # no Connection: close: on a frame connection it would end every request
                    # multiplexed on it; uvicorn's h11 keeps the connection usable after a 503
                    await ex.answer(d.status, f"request not admitted: {d.reason}", retry_after=d.retry_after,
                                    reason=d.reason)
                    return
                permit = d
                d.task = asyncio.current_task()   # its owner (numaserve.worker.permits)
                cpu.admitted(queued=False)   # (this task runs it: not a task waiting to start)
                conn = None
            else:
                conn = getattr(permit, "conn", None) or scope.pop(CONN_KEY, None)
            if not ex.hold(permit, now, conn):
                return   # waited so long its client left: not run
            deadline = permit.deadline
        if permit is None:
            await self._limited(scope, ex)
            return
        try:
            if deadline is None:
                receive = self._body_receive(scope, ex, now)
                if receive is None:
                    await self._answer_413(ex)
                else:
                    try:
                        await self.app(scope, receive, ex.send)
                    except Exception as e:
                        if not ex.refused:
                            raise
                        logger.debug("app raised after the edge answered %d: %s", ex.refused,
                                     describe_exception(e))
            else:
                timer = asyncio.timeout(max(0.0, deadline - self.cpu.clock()))
                try:
                    async with timer:
                        await self._limited(scope, ex)
                except TimeoutError:
                    if not timer.expired():
                        raise
                    ex.outcome = "dropped"
                    if not ex.started:
                        await ex.answer(504, "deadline passed while the request ran", reason="deadline")
                        return
                    raise
        except BaseException as e:
            ex.failed(e)
            raise

    def _body_receive(self, scope: Scope, ex: _Exchange, now: float = 0.0) -> Receive | None:
        """The ``receive`` the app gets (limited when there are limits); None: refused with 413.
        ``now``: the request's start on ``clock`` (0: read it)."""
        limit = self.max_body_bytes
        if limit <= 0 and self.read_timeout <= 0:
            return ex.raw_receive
        declared = -1
        expects_continue = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
            elif name == b"expect":
                expects_continue = value.lower() == b"100-continue"
        if limit > 0 and declared > limit:
            ex.refused = 413
            self.count_refusal(413)
            ex.started = True
            ex.status = 413
            # a client waiting for 100 Continue sends nothing: no need to linger
            ex.read_deadline = -1.0 if expects_continue or declared > LINGER_BYTES else None
            return None
        if self.read_timeout > 0:   # (made a loop time only if the app reads: a GET handler never does)
            ex.read_by = (now if now else self.clock()) + self.read_timeout
        return ex.receive

    async def _limited(self, scope: Scope, ex: _Exchange) -> None:
        """The body limits, then the app."""
        receive = self._body_receive(scope, ex)
        if receive is None:
            await self._answer_413(ex)
            return
        try:
            await self.app(scope, receive, ex.send)
        except Exception as e:
            if not ex.refused:
                raise
            logger.debug("app raised after the edge answered %d: %s", ex.refused, describe_exception(e))

    async def _answer_413(self, ex: _Exchange) -> None:
        await answer(ex.raw_send, 413, _too_large(self.max_body_bytes),
                     None if ex.read_deadline == -1.0 else ex.raw_receive)

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app's lifespan, recorded; an app that raises during its startup fails it.

        uvicorn ("auto") reads any exception from the lifespan call as "lifespan
        unsupported" and serves.  That fits an app that raises before it received
        anything (it does not speak lifespan); an app that received
        ``lifespan.startup`` and then raised before answering has failed its
        startup: it gets ``lifespan.startup.failed`` with the exception's text,
        so the worker exits 3 with that reason.
        """
        record = self.lifespan
        phase = {"received": False, "answered": False}

        async def recording_receive() -> Message:
            message = await receive()
            if message.get("type") == "lifespan.startup":
                phase["received"] = True
            return message

        async def recording_send(message: Message) -> None:
            kind = message.get("type")
            if kind == "lifespan.startup.failed":
                record.startup_failed_message = str(message.get("message") or "") or "no message"
            if kind in ("lifespan.startup.complete", "lifespan.startup.failed"):
                phase["answered"] = True
            await send(message)

        try:
            await self.app(scope, recording_receive, recording_send)
        except Exception as e:
            record.exception = describe_exception(e)
            if phase["received"] and not phase["answered"]:
                record.startup_failed_message = record.exception
                logging.getLogger("uvicorn.error").error("lifespan startup raised", exc_info=e)
                await recording_send({"type": "lifespan.startup.failed", "message": record.exception})
                return
            raise
        except BaseException as e:
            record.exception = describe_exception(e)
            raise

    # --- stats ----------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The admission part of Stats ``extra`` (``{}`` without admission)."""
        if self.cpu is None:
            return {}
        out = self.cpu.snapshot()
        for k, v in self.rejected.items():
            out["rejected_by_status"][str(k)] = out["rejected_by_status"].get(str(k), 0) + v
        return out


def _too_large(limit: int) -> str:
    return f"request body too large: over server.max_body_bytes ({limit} bytes)"


async def answer(send: Send, status: int, message: str, linger: Receive | None) -> None:
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


# --- the assembly ------------------------------------------------------------------------------


@dataclass
class Stack:
    """What ``build_stack`` made: the ASGI entry point, the edge, the admission runtime, the config."""

    app: ASGIApp
    edge: Edge
    runtime: Any          # AdmissionRuntime (the CPU gate) or None (admission off)
    config: Any           # uvicorn.Config


def build_stack(spec: Any, app: ASGIApp, stats: WorkerStats, lifespan: LifespanRecord | None = None,
                cache: Any = None) -> Stack:
    """The worker's ASGI chain (Edge -> cache -> app) and protocol chain, from its spec."""
    from numaserve.worker.serve import build_config

    if cache is not None:
        from numaserve.worker.cache import CacheMiddleware

        app = CacheMiddleware(app, cache)
    runtime = None
    adm = spec.admission
    if adm.enabled:
        from numaserve.worker.shedding import AdmissionRuntime

        runtime = AdmissionRuntime(adm)
    edge = Edge(app, stats=stats, lifespan=lifespan, cpu=runtime,
                default_timeout_s=adm.request_timeout_s, max_body_bytes=spec.max_body_bytes,
                read_timeout=spec.read_timeout)
    entry: ASGIApp = edge
    if spec.access_log:   # outermost: the edge's own answers (503 shed, 413, 408) are logged too
        from numaserve.accesslog import AccessLogMiddleware

        entry = AccessLogMiddleware(edge, spec.server.access_log_format)
    config = build_config(spec, entry, stats=stats, admission=runtime)
    return Stack(app=entry, edge=edge, runtime=runtime, config=config)


def assemble_for_bench(spec: Any, app: ASGIApp) -> tuple[type, Any, Any]:
    """(protocol class, loaded uvicorn config, server state) of a worker's stack, for
    ``scripts/bench_hotpath.py`` (no sockets, no supervisor)."""
    from uvicorn.server import ServerState

    stack = build_stack(spec, app, WorkerStats())
    config = stack.config
    config.load()
    state = ServerState()
    state.default_headers = [(b"date", b"Tue, 01 Dec 2026 12:00:00 GMT")]
    return config.http_protocol_class, config, state
