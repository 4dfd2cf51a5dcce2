"""Readiness of external ``server.cmd`` workers: they have no control channel, so the
supervisor probes the slot (``[cmd] ready``: tcp, http or alive) until the new
process accepts on its listener (and answers).  One probe task per worker.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import structlog

from numaserve.net.listeners import ListenerSet
from numaserve.supervisor import slots as S
from numaserve.cmdready import parse_ready
from numaserve.supervisor.probe import probe_slot, process_tree
from numaserve.supervisor.slottable import SlotTable
from numaserve.supervisor.steer import Steering

#: Seconds one readiness probe may take (connect, or a health request's answer): a local
#: server that has not answered in 2 s is not ready yet; the next probe asks again.
PROBE_TIMEOUT = 2.0
#: Seconds between probes of a loading server: ready within a quarter second of listening.
PROBE_INTERVAL = 0.25

__all__ = ["ExternalReadiness"]

log = structlog.get_logger("numaserve.supervisor")


class ExternalReadiness:
    def __init__(self, table: SlotTable, steering: Callable[[], Steering | None],
                 listeners: Callable[[], ListenerSet]) -> None:
        self.table = table
        self.steering = steering          # set (or not) when the supervisor opens
        self.listeners = listeners
        self.tasks: dict[int, asyncio.Task[None]] = {}   # id(worker) -> its probe loop

    def check(self, slot: S.SlotState, w: S.WorkerProc, now: float) -> None:
        """External commands have no control channel: the supervisor probes the
        slot (``[cmd] ready``) until the new process accepts (and answers)."""
        spec = parse_ready(self.table.cfg.cmd.ready)
        # a unix-only bind has no slot's own queue to route a probe to: the alive rule
        if spec.kind == "alive" or self.steering() is None or self.steering().paused \
                or not self.listeners().by_slot.get(slot.plan.slot):
            limit = self.table.cfg.supervisor.ready_timeout
            if now - w.started >= (min(1.0, limit) if limit > 0 else 1.0):
                w.last_beat = now
                self.table.on_ready(slot, w, now)
            return
        if id(w) not in self.tasks:
            self.tasks[id(w)] = asyncio.get_running_loop().create_task(
                self._loop(slot, w, spec), name=f"probe-{slot.plan.slot}-{w.generation}")

    async def _loop(self, slot: S.SlotState, w: S.WorkerProc, spec: Any) -> None:
        steering = self.steering()
        assert steering is not None
        lst = self.listeners().by_slot[slot.plan.slot][0]
        try:
            while w.ready is None and w.popen.poll() is None and not self.table.stopping:
                res = await probe_slot(steering, lst, slot.plan.slot, lambda: process_tree(w.pid), spec,
                                       PROBE_TIMEOUT)
                if res.note != w.probe_note:
                    log.debug("probe", slot=slot.plan.slot, pid=w.pid, ok=res.ok, note=res.note)
                w.probe_note = res.note
                if res.ok and w.popen.poll() is None:
                    now = time.monotonic()
                    w.last_beat = now
                    self.table.on_ready(slot, w, now)
                    self.table.wake.set()
                    return
                await asyncio.sleep(PROBE_INTERVAL)
        finally:
            self.tasks.pop(id(w), None)

    def stop(self, w: S.WorkerProc) -> None:
        t = self.tasks.pop(id(w), None)
        if t is not None:
            t.cancel()
