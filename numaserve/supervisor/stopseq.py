"""The stop sequence: readiness off → lb grace → accept queues taken → Stop → (kill).

Readiness goes off at once (``stopping``: /readyz 503); the workers keep
serving through ``server.lb_grace`` while balancers notice, then take what
is already queued (bounded by ``ACCEPT_SETTLE_MAX_S``), then are told to
stop; the supervisor's listener copies close so the kernel refuses new
connections instead of queueing them for a reset.  A second signal or
``stop --fast`` kills every worker.  The watchdog (lifecycle) kills what
outlives its deadline.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import structlog

from numaserve.supervisor.lbgrace import GraceDecision, ProbeClock, decide_lb_grace
from numaserve.supervisor.notify import Notifier
from numaserve.supervisor.slotcontrol import Routing
from numaserve.supervisor.slottable import SlotTable

__all__ = ["ACCEPT_SETTLE_MAX_S", "StopSequence"]

log = structlog.get_logger("numaserve.supervisor")

#: After lb_grace, how long the workers may take to accept what is queued before
#: they are told to stop (a connection left in a listener at close is reset).
ACCEPT_SETTLE_MAX_S = 5.0


class StopSequence:
    def __init__(self, table: SlotTable, routing: Routing, notifier: Notifier, probes: ProbeClock,
                 close_listeners: Callable[[], None]) -> None:
        self.table = table
        self.routing = routing
        self.notifier = notifier
        self.probes = probes                      # the admin app notes every /readyz
        self.close_listeners = close_listeners
        self.phase: str | None = None             # lb_grace -> accept_queue -> draining
        self.lb_grace_until: float | None = None
        self.fast = False
        self.task: asyncio.Task[None] | None = None

    def begin(self, reason: str, *, fast: bool, lb_grace: bool = True) -> None:
        """Readiness goes off now (``stopping``: /readyz 503); the workers keep
        serving through the lb grace, then take what is queued, then drain.
        ``fast`` kills every worker (a second signal, ``stop --fast``)."""
        first = self.table.begin_stop()
        cfg = self.table.cfg
        if first:
            log.info("stopping", reason=reason)
            self.notifier.stopping(f"stopping: {reason}")
        if fast:
            self.fast = True
            if self.task is not None:
                self.task.cancel()
            self.table.kill_all(time.monotonic())
            return
        if first:
            grace = (decide_lb_grace(cfg.server.lb_grace, self.probes.age()) if lb_grace
                     else GraceDecision(0.0, "nothing is serving: no balancer to wait for"))
            log.info("lb_grace", seconds=grace.seconds, reason=grace.reason)
            self.task = asyncio.get_running_loop().create_task(self._after_grace(grace.seconds), name="stop")

    async def _after_grace(self, grace: float) -> None:
        cfg = self.table.cfg
        try:
            if grace > 0:
                self.phase = "lb_grace"
                self.lb_grace_until = time.monotonic() + grace
                await asyncio.sleep(grace)
            # Workers still accept: let them take what the balancer sent before it
            # noticed (steering is frozen from here on, so no slot is left out).
            self.phase = "accept_queue"
            settle = min(ACCEPT_SETTLE_MAX_S, max(0.2, cfg.server.graceful_timeout / 4))
            end = time.monotonic() + settle
            while (queued := self._queued_on_serving_slots()) and time.monotonic() < end:
                await asyncio.sleep(0.02)
            if queued:
                log.warning("accept_queue_not_empty", connections=queued, waited_s=settle)
        except Exception as e:  # never let a stop hang on its preamble
            log.error("stop_preamble_failed", error=repr(e))
        self.phase = "draining"
        self.table.stop_all(time.monotonic(), cfg.server.graceful_timeout)
        # Each worker closes its copy of its listener as it stops accepting; with
        # ours closed too the socket goes away then, and the kernel refuses new
        # connections (a balancer without health checks retries a refused
        # connect safely) instead of queueing them until the final close resets them.
        self.close_listeners()
        self.table.wake.set()

    def _queued_on_serving_slots(self) -> int:
        """Connections waiting in the listeners of slots whose worker can still take them."""
        return self.routing.queued(slot.plan.slot for slot in self.table.slots.values()
                                   if slot.worker is not None and slot.worker.popen.poll() is None)

    def progress(self) -> bool:
        """Slots without a worker count as stopped; True once no worker is left."""
        return self.table.settle_stopped()
