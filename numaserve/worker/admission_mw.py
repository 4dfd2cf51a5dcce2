"""Admission control in front of the app: the L0 gate as ASGI middleware.

``CpuAdmissionMiddleware`` (limiter "cpu", the default) finishes what the
protocol started (``numaserve.worker.shedding``): the protocol admitted the
request at head-complete and left its permit in the scope; here the permit
is released when the request ends, a request whose client left while it
waited is not run, responses say ``Connection: close`` while the worker is
shedding, and deadlines give 504.  Requests the protocol did not see (frames,
h11) are decided here, by the same gate.  ``AdmissionMiddleware`` is the
gate of limiters "gradient" and "static" (in-flight limit + queue).

Each HTTP request asks the gate for a permit before the app sees it (and
before its body is read, so rejections are cheap).  Rejections are answered
at once with the fixed error classes: **503** + ``Retry-After`` (overload),
**429** + ``Retry-After`` (rate quota), **504** (deadline passed).  Requests
that run past their deadline get 504 if the response has not started; app
exceptions become **500**.  The outcome feeds the worker's gradient
controller (``numaserve.loops``): 504 → dropped (limit cut), 500 → ignored.

Deadlines: ``x-request-timeout`` (seconds, from the client) or the configured
default; none otherwise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from numaserve.errors_http import error_body as _error_body
from numaserve.errors_http import error_headers
from numaserve.loops.admission import (
    AdmissionGate,
    AdmissionMachine,
    AdmissionSettings,
    Reject,
    Rejected,
)
from numaserve.loops.gradient import GradientController, GradientSettings
from numaserve.worker.shedding import (
    CONN_KEY,
    PERMIT_KEY,
    AdmissionRuntime,
    request_deadline,
    runnable_tasks,
)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

DEADLINE_HEADER = b"x-request-timeout"
TICK_S = 0.05
REASONS = {503: "overloaded", 429: "rate_limited", 504: "timeout", 500: "internal"}


def make_gate(settings: AdmissionSettings, gradient: GradientSettings | None,
              clock: Callable[[], float] = time.monotonic) -> AdmissionGate:
    now = clock()
    controller = GradientController(gradient, now) if gradient is not None else None
    return AdmissionGate(AdmissionMachine(settings, now, controller), clock)


def error_body(status: int, message: str) -> bytes:
    """The shared error body (``numaserve.errors_http``)."""
    return _error_body(status, message)


async def send_error(send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = error_body(status, message)
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    *(headers or [])],
    })
    await send({"type": "http.response.body", "body": body})


_CLOSE = (b"connection", b"close")


def _with_close(message: dict[str, Any]) -> dict[str, Any]:
    headers = list(message.get("headers", ()))
    if not any(k.lower() == b"connection" for k, _ in headers):
        headers.append(_CLOSE)
    return {**message, "headers": headers}


class _Guarded:
    """Runs the app under a request's deadline and records the outcome for the gate.

    504 if the deadline passes before the response started; the outcome is
    set even when the app raises (read it in a ``finally``).
    """

    __slots__ = ("outcome",)

    def __init__(self) -> None:
        self.outcome = "ok"

    async def run(self, app: Any, scope: Scope, receive: Receive, send: Send, deadline: float | None,
                  clock: Callable[[], float], close_if: Callable[[], bool] | None = None) -> None:
        started = False
        status = 500

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started = True
                status = int(message["status"])
                if close_if is not None and close_if():
                    message = _with_close(message)
            await send(message)

        try:
            if deadline is None:
                await app(scope, receive, tracking_send)
            else:
                async with asyncio.timeout(max(0.0, deadline - clock())):
                    await app(scope, receive, tracking_send)
            if status >= 500:
                self.outcome = "dropped" if status == 504 else "ignored"
            elif status == 400:
                self.outcome = "bad_request"
        except TimeoutError:
            self.outcome = "dropped"
            if not started:
                await send_error(send, 504, "deadline passed while the request ran")
                return
            raise
        except asyncio.CancelledError:
            self.outcome = "dropped"
            raise
        except Exception:
            self.outcome = "ignored"
            raise


class CpuAdmissionMiddleware:
    """The ASGI half of limiter "cpu" (see the module docstring)."""

    def __init__(self, app: Any, rt: AdmissionRuntime) -> None:
        self.app = app
        self.rt = rt
        self.gate = rt.gate
        self.default_timeout_s = rt.s.request_timeout_s
        self.close_when_overloaded = rt.s.close_when_overloaded
        self.gone_after = rt.s.gone_check_after_s
        self.rejected: dict[int, int] = {}

    def _deadline(self, scope: Scope, arrived: float) -> float | None:
        return request_deadline(scope.get("headers") or (), arrived, self.default_timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rt = self.rt
        gate = self.gate
        now = rt.clock()
        permit = scope.pop(PERMIT_KEY, None)
        conn = scope.pop(CONN_KEY, None)
        if permit is None:  # not decided at the protocol (frames, h11)
            d = gate.try_admit(now, deadline=self._deadline(scope, now), runnable=runnable_tasks)
            if isinstance(d, Reject):
                self.rejected[d.status] = self.rejected.get(d.status, 0) + 1
                body = error_body(d.status, f"request not admitted: {d.reason}")
                # no Connection: close here: on a frame connection it would end every request
                # multiplexed on it; uvicorn's h11 keeps the connection usable after a 503
                await send({"type": "http.response.start", "status": d.status,
                            "headers": error_headers(d.status, body, d.retry_after or 1)})
                await send({"type": "http.response.body", "body": body})
                return
            permit = d.permit
            rt.admitted()
        elif conn is not None and now - permit.enqueued_at > self.gone_after and rt.client_gone(conn):
            gate.client_gone(now, permit)  # waited so long its client left: do not run it
            rt.finished()
            return
        rt.started(permit, now)
        run = _Guarded()
        close_if = (lambda: gate.shedding(rt.clock())) if self.close_when_overloaded else None
        try:
            await run.run(self.app, scope, receive, send, permit.deadline, rt.clock, close_if)
        finally:
            gate.release(rt.clock(), permit, run.outcome)  # type: ignore[arg-type]
            rt.finished()

    def snapshot(self) -> dict[str, Any]:
        out = self.rt.snapshot()
        for k, v in self.rejected.items():
            out["rejected_by_status"][str(k)] = out["rejected_by_status"].get(str(k), 0) + v
        return out


class AdmissionMiddleware:
    def __init__(self, app: Any, gate: AdmissionGate, *, default_timeout_s: float = 0.0) -> None:
        self.app = app
        self.gate = gate
        self.default_timeout_s = default_timeout_s
        self.rejected: dict[int, int] = {}

    def _deadline(self, scope: Scope, now: float) -> float | None:
        return request_deadline(scope.get("headers") or (), now, self.default_timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        now = self.gate.clock()
        deadline = self._deadline(scope, now)
        try:
            permit = await self.gate.acquire(deadline)
        except Rejected as r:
            self.rejected[r.status] = self.rejected.get(r.status, 0) + 1
            await send_error(send, r.status, f"request not admitted: {r.reason}", r.headers())
            return
        run = _Guarded()
        try:
            await run.run(self.app, scope, receive, send, deadline, self.gate.clock)
        finally:
            self.gate.release(permit, run.outcome)  # type: ignore[arg-type]

    def snapshot(self) -> dict[str, Any]:
        snap = self.gate.machine.snapshot(self.gate.clock(), reset_max=True)
        out = {f: getattr(snap, f) for f in snap.__struct_fields__}
        out["rejected_by_status"] = {str(k): v for k, v in self.rejected.items()}
        return out


async def tick_forever(gate: AdmissionGate) -> None:
    """Drive L1 windows, lease expiries and queued grants (the machine never reads a clock)."""
    while True:
        await asyncio.sleep(TICK_S)
        gate.tick()
