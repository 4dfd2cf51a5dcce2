"""One request's accounting at the worker's edge: counted, its admission permit held and given
back, a departed client not run, ``Connection: close`` while draining, its outcome judged.

Why one class: a request is served on one of two paths, folded into the HTTP protocol's
request cycle (``numaserve.worker.httpproto.LeanCycle.run_asgi``: body already in, no
deadline) or through the ``Edge`` layer (frames, h11, a body still arriving, a deadline,
``numaserve.worker.edge``).  Both must count the same way, hold the permit only while the
request can use CPU, and report the same outcome to the gate; this is the one place that
says how.  It reads the edge through public names only (``EdgeParts``).

Cost: no object of its own.  Each path's per-request object *is* one (``LeanCycle`` and the
edge's ``_Exchange`` inherit it), and the folded path makes four calls per request (``begin``,
``hold``, ``on_response_start``, ``finish``): the outcome is judged at ``finish`` by a table
lookup.  A stream's chunks after the first cost one attribute test.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Protocol

__all__ = ["OUTCOME_BY_STATUS", "EdgeParts", "RequestAcct"]

#: What the gate is told of a request that answered with a status (anything else is "ok"):
#: a 5xx is the server's failure ("ignored"), a 504 a deadline ("dropped"), a 400 the client's.
OUTCOME_BY_STATUS: dict[int, str] = {
    **dict.fromkeys(range(500, 1000), "ignored"), 504: "dropped", 400: "bad_request",
}


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

    A base class of each path's per-request object: ``begin`` when the request starts (its
    clock read, counted in flight), ``finish`` when it ends, however it ends.  ``permit``: the
    admission permit while held; ``status``: the response's (0: none yet); ``outcome``: what
    the gate is told at release, None until set ("ok", "ignored", "dropped", "bad_request";
    None at ``finish``: judged from ``status``).
    """

    __slots__ = ("edge", "outcome", "permit", "status", "t0")

    edge: EdgeParts
    outcome: str | None
    permit: Any
    status: int
    t0: float

    def begin(self, edge: EdgeParts) -> None:
        """The request starts: clock read, counted in flight, nothing held."""
        self.edge = edge
        self.permit = None
        self.outcome = None
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
        elif isinstance(exc, Exception) and self.outcome is None:
            self.outcome = "ignored"

    def judge(self) -> None:
        """The outcome from the status answered so far, now: for a path that answers after the
        app returned (uvicorn's 500 for an app that answered nothing is not the app's)."""
        self.outcome = OUTCOME_BY_STATUS.get(self.status, "ok")

    def finish(self) -> None:
        """The request is over: the permit back (if still held) and the request counted, with
        its latency, at one clock read.  An outcome not set yet is judged from the status.  No
        response counts as 500 (uvicorn answered 500, or the client left)."""
        edge = self.edge
        end = edge.clock()
        permit = self.permit
        if permit is not None:
            self.permit = None
            outcome = self.outcome
            if outcome is None:
                outcome = OUTCOME_BY_STATUS.get(self.status, "ok")
            edge.gate.release(end, permit, outcome)
        stats = edge.stats
        if stats is not None:
            stats.request_finished(self.status or 500, (end - self.t0) * 1000.0)
