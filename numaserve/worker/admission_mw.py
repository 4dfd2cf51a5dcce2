"""Admission control in front of the app: the gate's ASGI side, as configurations of the edge.

The decision logic lives in ``numaserve.loops`` (pure) and its I/O shell in
``numaserve.worker.shedding`` (probe, protocol hook, sentinel); the ASGI half
is part of the worker's one edge layer (``numaserve.worker.edge.Edge``):
the permit the protocol left in the scope is released when the request
ends (or its response turns into a stream), a request whose client left
while it waited is not run, responses say ``Connection: close`` while the
worker is shedding (``close_when_overloaded``), and deadlines give 504.
Requests the protocol did not see (frames, h11) are decided there, by the
same gate.

Rejections are answered at once with the fixed error classes: **503** +
``Retry-After`` (overload), **429** + ``Retry-After`` (rate quota), **504**
(deadline passed).  Requests that run past their deadline get 504 if the
response has not started; app exceptions become **500**.  The outcome feeds
the worker's gradient controller (``numaserve.loops``): 504 → dropped
(limit cut), 500 → ignored.

Deadlines: ``x-request-timeout`` (seconds, from the client) or the configured
default; none otherwise.

``CpuAdmissionMiddleware`` (limiter "cpu") and ``AdmissionMiddleware``
(limiters "gradient"/"static") are the edge with admission only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from numaserve.loops.admission import AdmissionGate, make_gate
from numaserve.worker.edge import Edge
from numaserve.worker.shedding import AdmissionRuntime

__all__ = ["TICK_S", "AdmissionMiddleware", "CpuAdmissionMiddleware", "make_gate", "tick_forever"]

TICK_S = 0.05


class CpuAdmissionMiddleware(Edge):
    """The edge with the "cpu" limiter only."""

    def __init__(self, app: Any, rt: AdmissionRuntime) -> None:
        super().__init__(app, cpu=rt)


class AdmissionMiddleware(Edge):
    """The edge with the asyncio ``AdmissionGate`` (limiters "gradient"/"static") only."""

    def __init__(self, app: Any, gate: AdmissionGate, *, default_timeout_s: float = 0.0) -> None:
        super().__init__(app, gate=gate, default_timeout_s=default_timeout_s)


async def tick_forever(gate: AdmissionGate) -> None:
    """Drive L1 windows, lease expiries and queued grants (the machine never reads a clock)."""
    while True:
        await asyncio.sleep(TICK_S)
        gate.tick()
