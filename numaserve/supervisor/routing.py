"""Where new connections go: the listeners, steering onto serving slots, rescue of stranded ones.

Every tick (``route``) the CBPF program is re-pointed at the slots that serve
now (``steer``), connections queued on a slot nobody will serve soon are
handed to a serving one (``Rescuer``), and with ``server.takeover`` the
program is paused while another owner shares the port group, then the
socket positions are measured again.  Reads slot state; writes none.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import structlog

from numaserve.bind.placement import Plan
from numaserve.net.listeners import ListenerSet, accept_queue_depth
from numaserve.supervisor import slots as S
from numaserve.supervisor.rescue import Rescuer
from numaserve.supervisor.slottable import SlotTable
from numaserve.supervisor.steer import Steering
from numaserve.topology.model import Topology

__all__ = ["Router", "crowd_cpus", "without_fd_limited"]

log = structlog.get_logger("numaserve.supervisor")


def without_fd_limited(healthy: Sequence[int], fd_limited: Iterable[int]) -> list[int]:
    """The healthy slots minus those whose worker is at its open-file limit (``fd_limited`` in its Stats).

    A worker out of fds resets every connection it is given (uvloop's EMFILE
    trick) or leaves it queued: with slot 0 at 64/64 fds, 21 of 40 new
    requests failed.  It is steered around like a hung worker until its
    fd watch clears the mark (``worker.fdwatch.RECENT_S`` after the last hit).
    When every healthy slot is limited, all keep their share: no slot better
    than another is left to send to.
    """
    limited = set(fd_limited)
    left = [s for s in healthy if s not in limited]
    return left if left else list(healthy)


def crowd_cpus(plan: Plan, concentrate: bool) -> dict[int, int]:
    """node -> CPUs its workers run on, for the steering hot set (empty: ``server.concentrate`` off)."""
    if not concentrate:
        return {}
    cpus: dict[int, set[int]] = {}
    for s in plan.slots:
        cpus.setdefault(s.node, set()).update(s.cpus)
    return {n: len(c) for n, c in cpus.items()}


class Router:
    """The listeners and the steering over them (``Routing`` for operations and the stop)."""

    def __init__(self, table: SlotTable, plan: Plan, *, steer_while_stopping: Callable[[], bool]) -> None:
        self.table = table
        self.plan = plan
        self.steer_while_stopping = steer_while_stopping   # the lb grace: slots still serve
        self.listeners = ListenerSet()
        self.steering: Steering | None = None
        self.rescuer = Rescuer()
        self.discovery_allowed = False                    # the loop runs (positions are probed by it)
        self._shared_next = 0.0                           # takeover: next look for other owners
        self._discovery: asyncio.Task[None] | None = None

    @property
    def slots(self) -> Mapping[int, S.SlotState]:
        return self.table.slots

    def open(self, listeners: ListenerSet, topology: Topology | None) -> None:
        """The listeners are bound; steer over them unless ``server.cmd`` binds its own sockets."""
        from numaserve.cmdready import host_port_placeholders

        self.listeners = listeners
        cfg = self.table.cfg
        own = host_port_placeholders(cfg.server.cmd) if cfg.server.cmd else []
        if own:
            # cmd.allow_host_port: the children bind their own sockets into the
            # group, at positions the supervisor does not know: no program
            log.warning("steering_off", reason="server.cmd binds its own sockets ({" + "}, {".join(own) + "})")
            return
        self.steering = Steering(
            self.listeners,
            mode=cfg.server.steering,
            cpu_node=topology.cpu_node() if topology else {},
            slot_node={s.slot: s.node for s in self.plan.slots},
            node_cpus=crowd_cpus(self.plan, cfg.server.concentrate),
            max_connections=cfg.server.max_connections,
            slot_cpus={s.slot: s.cpus for s in self.plan.slots},
        )
        self.check_shared_port(time.monotonic())

    def reconfigure(self) -> None:
        """A reload changed the config: steering mode and crowd settings follow it."""
        cfg = self.table.cfg
        if self.steering is None:
            return
        if self.steering.mode != cfg.server.steering:
            self.steering.mode = cfg.server.steering
            self.steering.healthy = None  # force a reattach
        self.steering.set_crowd(crowd_cpus(self.plan, cfg.server.concentrate), cfg.server.max_connections)

    def route(self, now: float) -> None:
        """New connections to the serving slots; stranded ones handed over; shared-port watch."""
        self.steer()
        self.rescue()
        self.check_shared_port(now)

    def queued(self, slots: Iterable[int]) -> int:
        """Connections waiting in these slots' listeners (Routing)."""
        return sum(accept_queue_depth(lst.sock) or 0 for n in slots for lst in self.listeners.by_slot.get(n, []))

    def healthy_slots(self) -> list[int]:
        """Slots that should receive new connections: a worker is serving there
        and answering (heartbeats no older than ``unresponsive_after``)."""
        return [s.plan.slot for s in self.slots.values() if s.state == S.READY and not s.drained
                and not (s.worker is not None and s.worker.unresponsive_since is not None)]

    def status(self) -> dict[str, Any] | None:
        if self.steering is None:
            return None
        out = self.steering.status()
        local = remote = 0
        for s in self.slots.values():
            c = s.totals_before.combined(*(x.stats for x in s.workers()))["connections"]
            local += c.get("local", 0)
            remote += c.get("remote", 0)
        out["connections_local"] = local
        out["connections_remote"] = remote
        out["locality_share"] = round(local / (local + remote), 4) if local + remote else None
        return out

    def steer(self) -> None:
        # during the lb grace the slots still serve: keep steering off dead ones
        if self.steering is not None and (not self.table.stopping or self.steer_while_stopping()):
            # while nothing serves yet, new connections wait on slots whose
            # worker is booting, never on one that failed or backs off
            booting = [s.plan.slot for s in self.slots.values()
                       if s.state == S.STARTING and s.worker is not None and not s.drained]
            stats = {s.plan.slot: s.worker.stats for s in self.slots.values() if s.worker is not None} \
                if self.steering.hot is not None else None
            # a worker at its fd limit resets what it is given: steered around like a hung one
            limited = [s.plan.slot for s in self.slots.values() if s.worker is not None
                       and s.worker.stats is not None and s.worker.stats.extra.get("fd_limited")]
            self.steering.update(without_fd_limited(self.healthy_slots(), limited), fallback=booting, stats=stats)

    def check_shared_port(self, now: float) -> None:
        """``server.takeover``: no program while another owner shares a group;
        once it left, measure where our sockets sit, then steer again."""
        st = self.steering
        if st is None or not self.table.cfg.server.takeover or now < self._shared_next:
            return
        self._shared_next = now + 2.0
        from numaserve.supervisor import takeover as T

        try:
            peers = T.group_peers(self.listeners)
        except OSError as e:
            log.warning("port_share_check_failed", error=str(e))
            return
        if peers:
            if st.paused is None:
                from numaserve.net.portowners import owners

                table = owners(p.inode for p in peers)
                who = sorted({f"pid {o.pid}" for p in peers for o in table.get(p.inode, [])}) or ["another user"]
                st.pause(f"port shared with {', '.join(who)} (takeover): kernel hash over both owners")
                log.warning("steering_paused", reason=st.paused, sockets=len(peers))
            return
        if st.paused is not None and (self._discovery is None or self._discovery.done()) and self.discovery_allowed:
            self._discovery = asyncio.get_running_loop().create_task(self._discover_positions())

    async def _discover_positions(self) -> None:
        from numaserve.supervisor.probe import process_tree
        from numaserve.supervisor.takeover import discover_positions

        st = self.steering
        assert st is not None
        owner: dict[int, int] = {}
        for s in self.slots.values():
            if s.worker is not None and s.worker.popen.poll() is None:
                owner.update({p: s.plan.slot for p in process_tree(s.worker.pid)})
        maps = []
        for first in self.listeners.by_slot[min(self.listeners.by_slot)]:
            found = await discover_positions(first, len(self.slots), owner.get)
            if found is None:
                log.info("steering_positions_unknown", address=first.address, retry_s=2.0)
                st.invalidate()  # our probes replaced the program: put back whatever we had
                return
            maps.append(found)
        st.resume(maps)
        log.info("steering_resumed", positions=[{str(k): v for k, v in sorted(m.items())} for m in maps])
        self.steer()

    def stranded_slots(self) -> list[int]:
        """Slots whose queued connections nobody will accept soon: no worker
        (backoff, failed, drained) or a worker that stopped answering."""
        out = []
        for s in self.slots.values():
            if s.state == S.DRAINING:
                continue  # its worker takes the queue before it is told to drain
            w = s.worker
            if (w is None and s.state in (S.BACKOFF, S.FAILED, S.DRAINED)) or \
                    (w is not None and s.state == S.READY and w.unresponsive_since is not None):
                out.append(s.plan.slot)
        return out

    def rescue(self) -> None:
        """Hand connections stranded on a non-serving slot to a serving one."""
        st = self.steering
        if st is None or self.table.stopping or not st.attached or not st.healthy:
            return
        healthy = set(st.healthy)
        stranded = [(sid, lst) for sid in self.stranded_slots() if sid not in healthy
                    for lst in self.listeners.by_slot.get(sid, [])]
        if stranded:
            self.rescuer.tick(stranded)

    def tasks(self) -> list[asyncio.Task[None]]:
        """What runs on its own (a position discovery), to cancel at shutdown."""
        return [self._discovery] if self._discovery is not None else []
