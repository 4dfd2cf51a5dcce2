"""Admission control in front of the app: the CPU gate's ASGI side, as a configuration of the edge.

The decision logic lives in ``numaserve.loops.cpu_gate`` (pure) and its I/O shell in
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
response has not started; app exceptions become **500**.

Deadlines: ``x-request-timeout`` (seconds, from the client) or the configured
default; none otherwise.
"""

from __future__ import annotations

from typing import Any

from numaserve.worker.edge import Edge
from numaserve.worker.shedding import AdmissionRuntime

__all__ = ["CpuAdmissionMiddleware"]


class CpuAdmissionMiddleware(Edge):
    """The edge with the CPU gate only (no stats, no body limits)."""

    def __init__(self, app: Any, rt: AdmissionRuntime) -> None:
        super().__init__(app, cpu=rt)
