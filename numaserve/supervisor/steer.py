"""Keep each listener group's CBPF program in step with the slots that may
take new connections.

Two jobs, one program per reuseport group (one group per bind address):
* steer new connections away from slots with no serving worker (crashed and
  waiting to restart, crash-looping, drained), so nothing new waits in a queue
  nobody accepts from; connections already queued there stay for the
  replacement worker (the listener is never closed);
* in ``numa`` mode, send each connection to a slot on the node of the CPU
  that received it (FACTS §7.4), falling back to a spread over the healthy
  slots when that node has none;
* while a node has more serving workers than CPUs (32 workers on 2 CPUs),
  give its new connections to a *hot set* of as many of its slots as it has
  CPUs (``HotSet``), the way a shared accept queue keeps a few processes
  busy: each hot worker then reads several requests per wake-up instead of
  32 interpreters each waking per request.  The set spills (doubles) as
  soon as one of its workers refuses work (503: short of CPU, stalled, at
  its in-flight cap) or fills ``server.max_connections``, a worker that
  stalled is left out of it for a while, and it shrinks back one halving
  per ``SPILL_HOLD_S`` of quiet.  Every listener stays open and keeps its
  queue: only which sockets new connections go to changes.

Group positions equal slot numbers: the supervisor listens in slot order and
never closes a slot's socket while it runs (FACTS §7.1).  The one exception
is a deliberate takeover (``server.takeover``): the group started with
another owner's sockets in front of ours, and once they closed, ours sit in
an order only a probe can tell; ``group_pos`` then holds what the probes
found, and no program is attached while another owner is in the group.
"""

from __future__ import annotations

import socket
import time
from typing import Any, Iterable, Mapping, Sequence

import structlog

from numaserve.net.listeners import ListenerSet
from numaserve.net.steering import (
    attach_reuseport_cbpf,
    build_selection_program,
    detach_reuseport_bpf,
    hot_set,
    numa_cpu_to_slot,
)

log = structlog.get_logger("numaserve.steering")

#: A spilled hot set halves back toward the node's CPU count after this long without a refusal.
SPILL_HOLD_S = 30.0
#: A hot worker that stalled (its sentinel answered for it) is left out of the set this long.
AVOID_S = 30.0
#: Refusals that more workers would have avoided (quota and deadline refusals would not).
SPILL_REASONS = ("cpu", "stalled", "limit")
#: A hot worker holding this share of ``server.max_connections`` spills its node's set.
FULL_SHARE = 0.9


class HotSet:
    """Which slots of each crowded node take new connections; see the module docstring.

    ``node_cpus``: node -> CPUs its workers run on (a node with no entry is
    never concentrated).  ``observe`` reads each hot worker's stats (new
    refusals, stalls, connections) when they change; ``pick`` returns the set
    for the slots healthy now.  Pure apart from the clock the caller passes.
    """

    def __init__(self, node_cpus: Mapping[int, int], slot_node: Mapping[int, int], *,
                 max_connections: int = 0, slot_cpus: Mapping[int, Sequence[int]] | None = None) -> None:
        self.node_cpus = {n: c for n, c in node_cpus.items() if c > 0}
        self.slot_node = dict(slot_node)
        self.slot_cpus = {s: tuple(c) for s, c in (slot_cpus or {}).items()}
        self.max_connections = max_connections
        self.node_slots = {n: sum(1 for s in self.slot_node.values() if s == n) for n in self.node_cpus}
        self.size = dict(self.node_cpus)         # node -> current hot-set size
        self.slots: tuple[int, ...] = ()         # the set picked last
        self.spills = 0
        self._busy_at: dict[int, float] = {}     # node -> last refusal seen on one of its hot workers
        self._avoid: dict[int, float] = {}       # slot -> left out of the set until then
        self._seen: dict[int, tuple[object, int, int, int]] = {}   # slot -> (stats, generation, refused, stalls)

    def crowded(self) -> bool:
        """Some node has more slots than CPUs (otherwise every healthy slot is hot)."""
        return any(self.node_slots[n] > c for n, c in self.node_cpus.items())

    def observe(self, now: float, stats: Mapping[int, Any]) -> None:
        """Spill a node whose hot worker refused work or filled up; shrink after a quiet hold."""
        hot = self.slots
        for slot, st in stats.items():   # every slot keeps a baseline: one that joins the set later
            seen = self._seen.get(slot)  # is judged by what it refuses from then on
            if st is None or (seen is not None and seen[0] is st):
                continue   # no stats, or the same message as last time
            adm = st.extra.get("admission") if isinstance(st.extra, dict) else None
            shed = (adm or {}).get("shed") or {}
            refused = sum(int(shed.get(r, 0) or 0) for r in SPILL_REASONS)
            stalls = int(((adm or {}).get("sentinel") or {}).get("stalls", 0) or 0)
            self._seen[slot] = (st, st.generation, refused, stalls)
            if slot not in hot:
                continue
            # nearly full: spill before its connections past server.max_connections get 503s
            full = bool(self.max_connections) and st.connections >= max(1, int(FULL_SHARE * self.max_connections))
            fresh = seen is not None and seen[1] == st.generation
            stalled = fresh and stalls > seen[3]    # type: ignore[index]
            if not (full or stalled or (fresh and refused > seen[2])):   # type: ignore[index]
                continue
            node = self.slot_node.get(slot, -1)
            if node not in self.size:
                continue
            if stalled:
                self._avoid[slot] = now + AVOID_S
            self._busy_at[node] = now
            grown = min(self.node_slots[node], 2 * self.size[node])
            if grown > self.size[node]:
                self.size[node] = grown
                self.spills += 1
                log.info("hot_set_spill", node=node, size=grown, cpus=self.node_cpus[node], slot=slot,
                         why="stalled" if stalled else "full" if full else "refused work")
        for node, size in self.size.items():
            base = self.node_cpus[node]
            if size > base and now - self._busy_at.get(node, now) >= SPILL_HOLD_S:
                self.size[node] = max(base, size // 2)
                self._busy_at[node] = now   # the next halving after another quiet hold
                log.info("hot_set_shrink", node=node, size=self.size[node], cpus=base)

    def pick(self, now: float, healthy: Sequence[int]) -> tuple[int, ...]:
        for s in [s for s, until in self._avoid.items() if until <= now]:
            del self._avoid[s]
        self.slots = hot_set(healthy, self.slot_node, self.size, keep=self.slots, avoid=self._avoid,
                             slot_cpus=self.slot_cpus)
        return self.slots

    def status(self) -> dict[str, object]:
        return {"slots": list(self.slots), "size": {str(n): v for n, v in sorted(self.size.items())},
                "cpus": {str(n): v for n, v in sorted(self.node_cpus.items())}, "spills": self.spills,
                "avoided": sorted(self._avoid)}


class Steering:
    def __init__(
        self,
        listeners: ListenerSet,
        *,
        mode: str = "hash",
        cpu_node: Mapping[int, int] | None = None,
        slot_node: Mapping[int, int] | None = None,
        node_cpus: Mapping[int, int] | None = None,
        max_connections: int = 0,
        slot_cpus: Mapping[int, Sequence[int]] | None = None,
    ) -> None:
        self.listeners = listeners
        self.mode = mode
        self.cpu_node = dict(cpu_node or {})
        self.slot_node = dict(slot_node or {})
        self.slots = sorted(listeners.by_slot)
        self.healthy: tuple[int, ...] | None = None
        # crowded nodes (more workers than CPUs): new connections to a few hot slots; None = never
        self.slot_cpus = dict(slot_cpus or {})   # slot -> CPUs its worker runs on (the hot set spreads over them)
        self.hot: HotSet | None = None
        self.set_crowd(node_cpus or {}, max_connections)
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

    def update(self, healthy: Iterable[int], *, fallback: Iterable[int] = (),
               stats: Mapping[int, Any] | None = None, now: float | None = None) -> bool:
        """Reattach when what the program encodes changed; returns True when it did.

        ``fallback``: where new connections wait while no slot is healthy
        (slots whose worker is still booting), so none lands on a slot that
        failed or is backing off; empty = the kernel's hash over every slot.
        ``stats``: slot -> its worker's latest Stats, read by the hot set of
        a crowded node (refusals and stalls spill it).
        """
        h = tuple(sorted(set(healthy)))
        targets = h
        if self.hot is not None and h:
            t = time.monotonic() if now is None else now
            if stats is not None:
                self.hot.observe(t, stats)
            targets = self.hot.pick(t, h)
        targets = targets or tuple(sorted(set(fallback)))
        if h != self.healthy:
            self.healthy = h
            self._applied = None
        self.targets = targets
        return self._apply()

    def set_crowd(self, node_cpus: Mapping[int, int], max_connections: int = 0) -> None:
        """(Re)configure the hot set (``server.concentrate``): node -> CPUs; empty = none.
        An unchanged configuration keeps the current set and its spill state."""
        old = self.hot
        if old is not None and old.node_cpus == {n: c for n, c in node_cpus.items() if c > 0}:
            old.max_connections = max_connections
            return
        hot = HotSet(node_cpus, self.slot_node, max_connections=max_connections, slot_cpus=self.slot_cpus)
        self.hot = hot if hot.crowded() else None
        if (old is None) != (self.hot is None):
            self.healthy = None   # recompute the targets at the next update

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
            "hot_set": None if self.hot is None else self.hot.status(),
            "updates": self.updates,
            "errors": self.errors,
            "last_error": self.last_error,
        }
