"""Keep each listener group's CBPF program in step with the slots that may
take new connections.

Two jobs, one program per reuseport group (one group per bind address):
* steer new connections away from slots with no serving worker (crashed and
  waiting to restart, crash-looping, drained), so nothing new waits in a queue
  nobody accepts from; connections already queued there stay for the
  replacement worker (the listener is never closed);
* in ``numa`` mode, send each connection to a slot on the node of the CPU
  that received it (FACTS §7.4), falling back to a spread over the healthy
  slots when that node has none.

Group positions equal slot numbers: the supervisor listens in slot order and
never closes a slot's socket while it runs (FACTS §7.1).
"""

from __future__ import annotations

import socket
from typing import Iterable, Mapping, Sequence

import structlog

from numaserve.listeners import ListenerSet
from numaserve.steering import (
    attach_reuseport_cbpf,
    build_selection_program,
    detach_reuseport_bpf,
    numa_cpu_to_slot,
)

log = structlog.get_logger("numaserve.steering")


class Steering:
    def __init__(
        self,
        listeners: ListenerSet,
        *,
        mode: str = "hash",
        cpu_node: Mapping[int, int] | None = None,
        slot_node: Mapping[int, int] | None = None,
    ) -> None:
        self.listeners = listeners
        self.mode = mode
        self.cpu_node = dict(cpu_node or {})
        self.slot_node = dict(slot_node or {})
        self.slots = sorted(listeners.by_slot)
        self.healthy: tuple[int, ...] | None = None
        self.attached = False
        self.errors = 0
        self.last_error: str | None = None
        self.updates = 0

    def program_for(self, healthy: Sequence[int], ipv6: bool) -> list[tuple[int, int, int, int]] | None:
        table = None
        if self.mode == "numa" and healthy:
            node_slots: dict[int, list[int]] = {}
            for s in healthy:
                node_slots.setdefault(self.slot_node.get(s, -1), []).append(s)
            table = numa_cpu_to_slot(self.cpu_node, node_slots, {s: s for s in self.slots})
        return build_selection_program(healthy=healthy, group_size=len(self.slots), cpu_to_pos=table, ipv6=ipv6)

    def update(self, healthy: Iterable[int]) -> bool:
        """Reattach when the healthy set changed; returns True when it did."""
        h = tuple(sorted(set(healthy)))
        if h == self.healthy:
            return False
        self.healthy = h
        self.updates += 1
        groups = self._groups()
        any_prog = False
        for first, ipv6 in groups:
            try:
                prog = self.program_for(h, ipv6)
                if prog is None:
                    detach_reuseport_bpf(first)
                else:
                    attach_reuseport_cbpf(first, prog)
                    any_prog = True
            except (OSError, ValueError) as e:
                self.errors += 1
                self.last_error = str(e)
                log.error("steering_attach_failed", error=str(e), healthy=list(h), mode=self.mode)
        self.attached = any_prog
        log.info("steering", mode=self.mode, healthy=list(h), slots=len(self.slots), program=any_prog)
        return True

    def _groups(self) -> list[tuple[socket.socket, bool]]:
        """One member socket per group (per bind address): the first slot's."""
        if not self.slots:
            return []
        return [(lst.sock, lst.family == socket.AF_INET6) for lst in self.listeners.by_slot[self.slots[0]]]

    def status(self) -> dict[str, object]:
        return {
            "mode": self.mode,
            "healthy_slots": list(self.healthy or ()),
            "program_attached": self.attached,
            "updates": self.updates,
            "errors": self.errors,
            "last_error": self.last_error,
        }
