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
never closes a slot's socket while it runs (FACTS §7.1).  The one exception
is a deliberate takeover (``server.takeover``): the group started with
another owner's sockets in front of ours, and once they closed, ours sit in
an order only a probe can tell; ``group_pos`` then holds what the probes
found, and no program is attached while another owner is in the group.
"""

from __future__ import annotations

import socket
from typing import Iterable, Mapping, Sequence

import structlog

from numaserve.net.listeners import ListenerSet
from numaserve.net.steering import (
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
        self.targets: tuple[int, ...] = ()        # healthy, else the fallback (slots still booting)
        self.probes: dict[int, int] = {}          # probe source port -> slot (supervisor.probe)
        self.paused: str | None = None            # why no program may be attached (port shared with others)
        # per group (bind address): slot -> group position; identity unless a takeover reshuffled it
        self.group_pos: list[dict[int, int]] = [{s: s for s in self.slots} for _ in self._groups()]
        self._applied: tuple[object, ...] | None = None
        self.attached = False
        self.errors = 0
        self.last_error: str | None = None
        self.updates = 0

    def program_for(self, healthy: Sequence[int], ipv6: bool, probes: Mapping[int, int] | None = None,
                    pos: Mapping[int, int] | None = None) -> list[tuple[int, int, int, int]] | None:
        """The program for slots ``healthy`` (probes: source port -> slot); ``pos``: slot -> group position."""
        pos = dict(pos) if pos is not None else {s: s for s in self.slots}
        table = None
        if self.mode == "numa" and healthy:
            node_slots: dict[int, list[int]] = {}
            for s in healthy:
                node_slots.setdefault(self.slot_node.get(s, -1), []).append(s)
            table = numa_cpu_to_slot(self.cpu_node, node_slots, pos)
        return build_selection_program(healthy=[pos[s] for s in healthy], group_size=len(self.slots),
                                       cpu_to_pos=table, ipv6=ipv6,
                                       probes={sp: pos[s] for sp, s in (probes or {}).items()})

    def update(self, healthy: Iterable[int], *, fallback: Iterable[int] = ()) -> bool:
        """Reattach when what the program encodes changed; returns True when it did.

        ``fallback``: where new connections wait while no slot is healthy
        (slots whose worker is still booting), so none lands on a slot that
        failed or is backing off; empty = the kernel's hash over every slot.
        """
        h = tuple(sorted(set(healthy)))
        targets = h or tuple(sorted(set(fallback)))
        if h != self.healthy:
            self.healthy = h
            self._applied = None
        self.targets = targets
        return self._apply()

    def pause(self, reason: str) -> None:
        """No program while another owner shares the group (takeover): the kernel hash decides."""
        self.paused = reason
        self._apply()

    def resume(self, group_pos: list[dict[int, int]]) -> None:
        """Steer again with the measured positions of our sockets in each group."""
        self.group_pos = group_pos
        self.paused = None
        self._applied = None

    def invalidate(self) -> None:
        """Something else replaced the attached program: reattach ours at the next update."""
        self._applied = None

    def add_probe(self, sport: int, slot: int) -> None:
        """Route connections from source port ``sport`` to ``slot`` (attached before returning)."""
        self.probes[sport] = slot
        self._apply()

    def remove_probe(self, sport: int) -> None:
        if self.probes.pop(sport, None) is not None:
            self._apply()

    def _apply(self) -> bool:
        key = (self.targets, tuple(sorted(self.probes.items())), self.mode, self.paused)
        if key == self._applied:
            return False
        self._applied = key
        self.updates += 1
        if self.paused:
            self.attached = False
            return True
        any_prog = False
        for gi, (first, ipv6) in enumerate(self._groups()):
            try:
                prog = self.program_for(self.targets, ipv6, self.probes, self.group_pos[gi])
                if prog is None:
                    detach_reuseport_bpf(first)
                else:
                    attach_reuseport_cbpf(first, prog)
                    any_prog = True
            except (OSError, ValueError) as e:
                self.errors += 1
                self.last_error = str(e)
                log.error("steering_attach_failed", error=str(e), targets=list(self.targets), mode=self.mode)
        changed = any_prog != self.attached
        self.attached = any_prog
        if changed or not self.probes:
            log.info("steering", mode=self.mode, healthy=list(self.healthy or ()), targets=list(self.targets),
                     slots=len(self.slots), program=any_prog)
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
            "target_slots": list(self.targets),
            "program_attached": self.attached,
            "paused": self.paused,
            "probes": len(self.probes),
            "updates": self.updates,
            "errors": self.errors,
            "last_error": self.last_error,
        }
