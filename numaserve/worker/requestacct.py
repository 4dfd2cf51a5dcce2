"""One request's accounting at the worker's edge: counted, its admission permit held and given
back, a departed client not run, ``Connection: close`` while draining, its outcome judged.

Why one class: a request is served on one of two paths, folded into the HTTP protocol's
request cycle (``numaserve.worker.httpproto.LeanCycle.run_asgi``: body already in, no
deadline) or through the ``Edge`` layer (frames, h11, a body still arriving, a deadline,
``numaserve.worker.edge``).  Both must count the same way, hold the permit only while the
request can use CPU, and report the same outcome to the gate; this is the one place that
says how.  It reads the edge through public names only (``EdgeParts``).

Cost: one small object per request (``__slots__``); the per-chunk work of a stream is one
attribute test.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Protocol

__all__ = ["EdgeParts", "RequestAcct"]


class EdgeParts(Protocol):
    """What the accounting reads from the worker's ``Edge`` (``numaserve.worker.edge``)."""

    stats: Any          # WorkerStats or None (no counting)
    cpu: Any            # AdmissionRuntime or None (no admission: no permits)
    gate: Any           # the runtime's CpuGate, or None
    gone_after: float   # a permit older than this: check its client is still there
    close_when_overloaded: bool   # Connection: close while the gate sheds, too
    clock: Callable[[], float]


class RequestAcct:
    """One request, from its start to its end (see the module docstring).

    Made when the request starts (its clock read, counted in flight); ``finish`` when it ends,
    however it ends.  ``permit``: the admission permit while held; ``status``: the response's
    (0: none yet); ``outcome``: what the gate is told at release ("ok", "ignored", "dropped",
    "bad_request").
    """

    __slots__ = ("edge", "outcome", "permit", "status", "t0")

    def __init__(self, edge: EdgeParts) -> None:
        self.edge = edge
        self.permit: Any = None
        self.outcome = "ok"
        self.status = 0
        self.t0 = edge.clock()
        stats = edge.stats
        if stats is not None:
            stats.inflight += 1

    def hold(self, permit: Any, now: float, conn: Any) -> bool:
        """Run an admitted request under ``permit``; False when it waited past
        ``admission.gone_check_after_s`` and its client (``conn``, None: not checked) left:
        the permit is given back as "client gone" and the request must not run."""
        edge = self.edge
        cpu = edge.cpu
        if conn is not None and now - permit.enqueued_at > edge.gone_after and cpu.client_gone(conn):
            edge.gate.client_gone(now, permit)
            return False
        cpu.started(permit, now)
        self.permit = permit
        return True

    def on_response_start(self, status: int) -> bool:
        """The response starts with ``status``; True when it must say ``Connection: close``
        (the worker drains, or sheds with ``admission.close_when_overloaded``)."""
        self.status = status
        edge = self.edge
        stats = edge.stats
        if stats is not None and stats.draining:
            return True
        return edge.close_when_overloaded and edge.gate.shedding(edge.clock())

    def streaming(self) -> None:
        """A body chunk with more to come: a stream between two chunks uses no CPU, so it holds
        no permit (docs/admission.md)."""
        permit = self.permit
        if permit is not None:
            self.permit = None
            edge = self.edge
            edge.gate.release(edge.clock(), permit, "ok")

    def failed(self, exc: BaseException) -> None:
        """The app (or the wait for it) raised ``exc``: cancelled is "dropped", an error
        "ignored" unless an outcome was already set (a deadline's "dropped")."""
        if isinstance(exc, asyncio.CancelledError):
            self.outcome = "dropped"
        elif isinstance(exc, Exception) and self.outcome == "ok":
            self.outcome = "ignored"

    def judge(self) -> None:
        """The app returned: the outcome from the status it answered (before uvicorn's 500 for
        an app that answered nothing, which is not the app's error status)."""
        status = self.status
        if status >= 500:
            self.outcome = "dropped" if status == 504 else "ignored"
        elif status == 400:
            self.outcome = "bad_request"

    def finish(self) -> None:
        """The request is over: the permit back (if still held) and the request counted, with
        its latency, at one clock read.  No response counts as 500 (uvicorn answered 500, or
        the client left)."""
        edge = self.edge
        end = edge.clock()
        permit = self.permit
        if permit is not None:
            self.permit = None
            edge.gate.release(end, permit, self.outcome)
        stats = edge.stats
        if stats is not None:
            stats.request_finished(self.status or 500, (end - self.t0) * 1000.0)
