"""Admission control in front of the app: the L0 gate as ASGI middleware.

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
import json
import time
from typing import Any, Awaitable, Callable

from numaserve.loops.admission import AdmissionGate, AdmissionMachine, AdmissionSettings, Rejected
from numaserve.loops.gradient import GradientController, GradientSettings

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
    return json.dumps({"error": {"type": REASONS.get(status, "error"), "code": status, "message": message}}).encode()


async def send_error(send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = error_body(status, message)
    await send({
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    *(headers or [])],
    })
    await send({"type": "http.response.body", "body": body})


class AdmissionMiddleware:
    def __init__(self, app: Any, gate: AdmissionGate, *, default_timeout_s: float = 0.0) -> None:
        self.app = app
        self.gate = gate
        self.default_timeout_s = default_timeout_s
        self.rejected: dict[int, int] = {}

    def _deadline(self, scope: Scope, now: float) -> float | None:
        for name, value in scope.get("headers") or ():
            if name == DEADLINE_HEADER:
                try:
                    t = float(value)
                except ValueError:
                    break
                if t > 0:
                    return now + t
        return now + self.default_timeout_s if self.default_timeout_s > 0 else None

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
        started = False
        status = 500

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started, status
            if message["type"] == "http.response.start":
                started = True
                status = int(message["status"])
            await send(message)

        outcome = "ok"
        try:
            if deadline is None:
                await self.app(scope, receive, tracking_send)
            else:
                remaining = max(0.0, deadline - self.gate.clock())
                async with asyncio.timeout(remaining):
                    await self.app(scope, receive, tracking_send)
            if status >= 500:
                outcome = "dropped" if status == 504 else "ignored"
            elif status == 400:
                outcome = "bad_request"
        except TimeoutError:
            outcome = "dropped"
            if not started:
                await send_error(send, 504, "deadline passed while the request ran")
                return
            raise
        except asyncio.CancelledError:
            outcome = "dropped"
            raise
        except Exception:
            outcome = "ignored"
            raise
        finally:
            self.gate.release(permit, outcome)  # type: ignore[arg-type]

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
