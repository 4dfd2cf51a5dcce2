"""gunicorn's fallback recycle: replace a worker after ``worker.max_requests`` requests
(plus 0..``max_requests_jitter``) or ``worker.max_lifetime`` seconds (plus up to 10 %).

The worker reports its request count on the heartbeat stats; the supervisor
decides here and recycles through the tracked make-before-break path
(``Operations.replace_slot``): the new generation must be Ready on the same
listener before the old one drains, so no request is dropped.  One recycle
runs at a time (operations never interleave), so a node never loses more than
one worker's share to recycling.  Each worker draws its own jitter once, so
workers started together do not all recycle together.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import structlog

from numaserve.supervisor import slots as S
from numaserve.supervisor.operations import RUNNING, Operations
from numaserve.supervisor.slotcontrol import SlotControl

log = structlog.get_logger("numaserve.recycle")

LIFETIME_JITTER = 0.10   # a worker's lifetime limit is max_lifetime x (1 + uniform(0, this))
RETRY_AFTER_FAILURE = 60.0   # seconds before a slot whose recycle failed (new worker not ready) is tried again


@dataclass(frozen=True)
class Limits:
    """One worker generation's drawn limits (0 = none)."""

    generation: int
    requests: int
    lifetime: float


def draw_limits(generation: int, max_requests: int, jitter: int, max_lifetime: float,
                rng: random.Random) -> Limits:
    """The limits of one worker: the configured ones plus its own random jitter."""
    requests = max_requests + (rng.randint(0, jitter) if max_requests and jitter else 0)
    lifetime = max_lifetime * (1.0 + rng.uniform(0.0, LIFETIME_JITTER)) if max_lifetime else 0.0
    return Limits(generation, requests, lifetime)


def due_reason(limits: Limits, requests: int, age_s: float) -> str | None:
    """Why a worker with this count and age must be recycled now (None: not yet)."""
    if limits.requests and requests >= limits.requests:
        return f"max_requests: {requests} requests served (limit {limits.requests})"
    if limits.lifetime and age_s >= limits.lifetime:
        return f"max_lifetime: up {age_s:.0f}s (limit {limits.lifetime:.0f}s)"
    return None


class AgeRecycle:
    """Watches every serving worker's request count and age; starts one recycle when one is due."""

    def __init__(self, ctl: SlotControl, operations: Operations, rng: random.Random | None = None) -> None:
        self.ctl = ctl
        self.operations = operations
        self.rng = rng or random.Random()
        self.limits: dict[int, Limits] = {}   # slot -> its current worker's limits
        self.not_before: dict[int, float] = {}  # slot -> monotonic time its next try may start (after a failure)

    def _limits(self, slot: S.SlotState, w: S.WorkerProc) -> Limits:
        lim = self.limits.get(slot.plan.slot)
        if lim is None or lim.generation != w.generation:
            wc = self.ctl.cfg.worker
            lim = draw_limits(w.generation, wc.max_requests, wc.max_requests_jitter, wc.max_lifetime, self.rng)
            self.limits[slot.plan.slot] = lim
        return lim

    def tick(self, now: float) -> None:
        """Start at most one recycle (``now``: monotonic, as worker start times are)."""
        wc = self.ctl.cfg.worker
        if not (wc.max_requests or wc.max_lifetime) or self.ctl.stopping:
            return
        current = self.operations.current
        if current is not None and current.state == RUNNING:
            return
        for slot in self.ctl.slots.values():
            w = slot.worker
            if w is None or slot.state != S.READY or slot.drained or w.ready is None or w.stop_sent is not None:
                continue
            if slot.incoming is not None or now < self.not_before.get(slot.plan.slot, 0.0):
                continue
            reason = due_reason(self._limits(slot, w), w.stats.requests if w.stats else 0, now - w.started)
            if reason is not None:
                self._start(slot, w, reason)
                return

    def _start(self, slot: S.SlotState, w: S.WorkerProc, reason: str) -> None:
        kind = reason.partition(":")[0]
        log.info("worker_recycle", slot=slot.plan.slot, pid=w.pid, generation=w.generation, reason=reason)
        try:
            op = self.operations.start(kind, {"slot": slot.plan.slot, "reason": reason}, [slot.plan.slot],
                                       lambda op: self.operations.recycle(op, slot, reason))
        except Exception as e:  # another operation won the race: due again at the next tick
            log.info("worker_recycle_deferred", slot=slot.plan.slot, why=str(e))
            return
        op.on_finish.append(lambda op: self._finished(slot.plan.slot, op))

    def _finished(self, slot: int, op: Any) -> None:
        """A failed recycle (the old worker kept serving) is not retried every tick: the new
        worker would crash-loop beside a healthy one."""
        if op.state != "succeeded":
            self.not_before[slot] = time.monotonic() + RETRY_AFTER_FAILURE
            log.warning("worker_recycle_failed", slot=slot, result=op.result, retry_in_s=RETRY_AFTER_FAILURE)


__all__ = ["AgeRecycle", "Limits", "draw_limits", "due_reason", "LIFETIME_JITTER"]
