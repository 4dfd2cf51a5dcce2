"""Permits by construction: every admitted request's permit has one owner, and an audit proves it.

A permit of the "cpu" limiter (``numaserve.loops.cpu_gate.CpuPermit``) counts
one request in flight.  Its owner is what keeps the request alive:

* admitted by the HTTP protocol at head-complete (``numaserve.worker.
  httpproto``): the connection (``permit.conn``) while the request waits in
  the pipeline, then the asyncio task that runs it (``permit.task``).  The
  protocol releases it on every path: the request's end (or its stream's
  first chunk), the task's done callback (a task cancelled before it ever
  ran has no ``finally``), and ``connection_lost`` for the requests queued
  behind the running one that never started;
* admitted by the ``Edge`` (frames, h11): the task that runs it.

Release is idempotent (``CpuGate.release`` ignores a released permit), so
every path may release without knowing whether another already did.

``audit(gate)`` checks the invariant: the gate's in-flight count equals its
unreleased permits, and each of those has a live owner.  ``PermitWatch``
runs it in production (with the worker's stats): a permit seen without an
owner at two checks in a row is released, and the first breach is logged
once, loudly, with the numbers — an in-flight count that only grows would
otherwise end in a ceiling under it and every request answered 503.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

__all__ = ["PermitAudit", "PermitWatch", "audit", "owner_alive"]

logger = logging.getLogger("numaserve.worker")


@dataclass(frozen=True)
class PermitAudit:
    """One check: ``inflight`` (the gate's count), ``live`` (its unreleased permits),
    ``orphans`` (unreleased permits whose owner is gone)."""

    inflight: int
    live: int
    orphans: int

    @property
    def ok(self) -> bool:
        return self.inflight == self.live and self.orphans == 0


def owner_alive(permit: Any) -> bool:
    """Whether what holds ``permit`` can still release it: its task not done, or (before it
    has a task) its connection not lost.  A permit with neither is not judged (True)."""
    task = getattr(permit, "task", None)
    if task is not None:
        return not task.done()
    conn = getattr(permit, "conn", None)
    if conn is not None:
        return not getattr(conn, "lost", False)
    return True


def _orphans(gate: Any) -> list[Any]:
    return [p for p in list(gate.live) if not p.released and not owner_alive(p)]


def audit(gate: Any) -> PermitAudit:
    """The invariant check (tests assert ``ok``)."""
    return PermitAudit(gate.inflight, len(gate.live), len(_orphans(gate)))


class PermitWatch:
    """The production side of ``audit``: release what has been orphaned for two checks, log once."""

    def __init__(self) -> None:
        self._suspects: set[Any] = set()
        self.released = 0       # orphaned permits released by the watch (a bug if ever > 0)
        self.logged = False

    def check(self, gate: Any, now: float) -> PermitAudit:
        """Audit ``gate``; repair what is certainly broken.  A permit without an owner is released
        only when it was already so at the previous check (a task's done callback runs one loop
        iteration after the task is done: no false alarm in between)."""
        orphans = _orphans(gate)
        before = PermitAudit(gate.inflight, len(gate.live), len(orphans))
        confirmed = [p for p in orphans if p in self._suspects]
        self._suspects = set(orphans).difference(confirmed)
        for p in confirmed:
            gate.release(now, p, "dropped")
        self.released += len(confirmed)
        drift = gate.inflight != len(gate.live)
        if drift:
            gate.inflight = len(gate.live)
        if (confirmed or drift) and not self.logged:
            self.logged = True
            logger.error("permit invariant broken: %d in flight, %d unreleased permits, %d without a live "
                         "owner released (in-flight count set to %d); this is a bug, please report it",
                         before.inflight, before.live, len(confirmed), gate.inflight)
        return before
