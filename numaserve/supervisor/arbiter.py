"""The supervisor: the composition root that owns the loop and wires the roles together.

Shape (gunicorn's arbiter, nginx's master that owns the listeners):

    start:  runtime dir (lock, stale files) → listeners (all slots, before
            any worker) → ZeroMQ sockets → spawn every slot
    loop:   every tick (≤ 0.2 s, woken early by SIGCHLD and messages):
            reap → restart due / readiness → guard (watchdog, verify, limits,
            memory) → route (steer, rescue) → report (systemd, stats)
    stop:   ``stopseq``: readiness off → lb grace → accept queues → Stop → kill

The roles live in their own modules and are composed here: ``slottable``
(the one writer of slot state: spawn/reap/backoff/watchdog from ``lifecycle``,
the generation swap, drain and stop), ``spawner`` (the spawn seam),
``routing`` (listeners, steering, rescue), ``opsplane`` (worker channel, ops
and event sockets, front doors, admin), ``channel``/``workermsgs`` (worker
messages), ``operations`` and the ops verbs (``ops``, ``ops_cache``) through
the ``SlotControl``/``Routing``/``OpsTarget`` protocols, ``watches``,
``stopseq``, ``reload``, ``statusview``, ``notify``.  Signal handlers only
enqueue (a flag, a wake-up, or an ops request: SIGHUP is ``reload`` on the
audited ops path).
"""

from __future__ import annotations

import asyncio
import math
import signal
import time
from pathlib import Path
from typing import Any

import structlog

from numaserve.bind.placement import Plan
from numaserve.config import Config
from numaserve.net.listeners import accept_queue_depth, open_listeners
from numaserve.unixaddr import parse_mode, resolve_group
from numaserve.runtime import AUDIT_LOG, RuntimeDir
from numaserve.supervisor import fdbudget, irqstart
from numaserve.supervisor import slots as S
from numaserve.supervisor.admin import LoopHeartbeat
from numaserve.supervisor.agerecycle import AgeRecycle
from numaserve.supervisor.audit import AuditLog
from numaserve.supervisor.backoff import RestartPolicy, RestartState
from numaserve.supervisor.channel import WorkerChannel
from numaserve.supervisor.cmdprobe import ExternalReadiness
from numaserve.supervisor.lbgrace import ProbeClock
from numaserve.supervisor.leakwatch import LeakWatch
from numaserve.supervisor.lifecycle import (  # noqa: F401  (exit statuses: re-exported)
    EXIT_ERROR,
    EXIT_FORCED,
    EXIT_NO_SLOT,
    EXIT_OK,
    EXIT_USAGE,
    Lifecycle,
)
from numaserve.supervisor.limits import LimitsManager
from numaserve.supervisor.localitywatch import LocalityWatch
from numaserve.supervisor.notify import Notifier, status_line
from numaserve.supervisor.operations import Operations
from numaserve.supervisor.opsplane import OpsPlane
from numaserve.supervisor.reload import Reloader
from numaserve.supervisor.routing import Router
from numaserve.supervisor.spawner import Spawner, progress_file
from numaserve.supervisor.statusview import slot_statuses, supervisor_status
from numaserve.supervisor.stopseq import ACCEPT_SETTLE_MAX_S, StopSequence  # noqa: F401  (re-exported)
from numaserve.supervisor.templates import TemplateManager
from numaserve.supervisor.watches import SecondWatches
from numaserve.supervisor.workermsgs import WorkerMessageHandler
from numaserve.topology.model import Topology

log = structlog.get_logger("numaserve.supervisor")

TICK = 0.2
#: The longest tick while every slot is settled (``SlotState.settled``): nothing to
#: restart, stop or hand over, so the loop wakes for SIGCHLD, commands and the
#: deadlines it knows (the beat grid, the first heartbeat that could go missing,
#: the systemd watchdog); the per-second duties (memory, fds, stats) keep their
#: pace, and /healthz's loop age stays far under its 5 s limit.
IDLE_TICK = 1.0
#: Settled, the tick comes this long after each point of the workers' beat grid
#: (``numaserve.worker.control.next_beat_due``: every worker beats at
#: ``k * heartbeat_interval`` + its slot's phase, ≤ 6.4 ms): one interval's beats
#: are in the socket by then and the tick reads them all in one pass.
BEAT_SETTLE_S = 0.03


def last_grid_point(now: float, interval: float, settle: float) -> float:
    """The latest point ``k * interval`` of the beat grid whose beats are due in by ``now``
    (``settle`` after it)."""
    return math.floor((now - settle) / interval) * interval


def after_grid(now: float, interval: float, settle: float) -> float:
    """Seconds from ``now`` to ``settle`` after the next point of the beat grid."""
    return last_grid_point(now, interval, settle) + interval + settle - now


class Supervisor:
    def __init__(
        self, cfg: Config, plan: Plan, runtime: RuntimeDir, *, config_path: str | None = None,
        topology: Topology | None = None, overrides: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.plan = plan
        self.runtime = runtime
        sup = cfg.supervisor
        policy = RestartPolicy(
            initial=sup.backoff_initial,
            maximum=sup.backoff_max,
            reset_after=sup.backoff_reset_after,
            loop_limit=sup.crash_loop_limit,
            loop_window=sup.crash_loop_window,
            failed_retry=sup.failed_retry_interval,
        )
        slots = {p.slot: S.SlotState(plan=p, restart=RestartState(policy)) for p in plan.slots}
        self.channel = WorkerChannel(slots)
        self.spawner = Spawner(runtime, self.channel, topology=topology)
        self.table = Lifecycle(cfg, slots, policy, spawn_worker=self.spawner, wake=asyncio.Event(),
                               started=time.monotonic(), send_message=self.channel.send_soon,
                               on_spawn_error=lambda e: self.plane.note_fd_exhaustion("spawn", e))
        self.limits = LimitsManager(self.table, self.channel)
        self.messages = WorkerMessageHandler(self.table, self.channel, on_hello=self.limits.on_hello)
        self.plane = OpsPlane(cfg, runtime, count_bad=self.messages.count_bad)
        self.audit = AuditLog(Path(cfg.ops.audit_log) if cfg.ops.audit_log else runtime.path / AUDIT_LOG)
        self.state = "starting"
        self.heartbeat = LoopHeartbeat()          # beaten every loop tick; /healthz reads it
        self.readyz_probes = ProbeClock()         # the admin app notes every /readyz
        self.notifier = Notifier()
        self.router = Router(self.table, plan, steer_while_stopping=lambda: self.stopper.phase == "lb_grace")
        self.stopper = StopSequence(self.table, self.router, self.notifier, self.readyz_probes,
                                    close_listeners=lambda: self.router.listeners.close())
        self.operations = Operations(self.table, self.router)
        self.templates = TemplateManager(             # per-node warm templates ([worker] start = "fork")
            self.table, plan.slots, policy=policy, notifier=self.notifier,
            progress_file=lambda name: progress_file(runtime, name),
            gpus=lambda: self.spawner.topology.gpus if self.spawner.topology else ())
        self.spawner.templates = self.templates
        self.cmd_ready = ExternalReadiness(self.table, lambda: self.router.steering, lambda: self.router.listeners)
        self.table.on_exit = self.cmd_ready.stop     # a probe ends with its worker
        self.watches = SecondWatches(
            LeakWatch(self.table, self.channel, self.operations),
            AgeRecycle(self.table, self.operations),
            LocalityWatch(self.table, self.operations, self.spawner.node_cpus),
            fds=lambda: self.plane.fdwatch)
        self.reloader = Reloader(self.table, plan, config_path=config_path, overrides=overrides or {},
                                 operations=self.operations, templates=self.templates, notifier=self.notifier,
                                 plane=self.plane, router=self.router, spawner=self.spawner,
                                 status_line=self.status_line)
        self.irq: tuple[dict[str, Any] | None, str | None] = (None, None)   # status, state file to restore

    @property
    def stopping(self) -> bool:
        """Readiness is off (/healthz, /readyz: 503)."""
        return self.table.stopping

    # ------------------------------------------------------------------ start

    def open(self) -> None:
        """Everything that can fail before a worker exists (raises NumaserveError)."""
        cfg = self.table.cfg
        old_soft, limit, hard = fdbudget.raise_nofile()
        if limit != old_soft:
            log.info("nofile_raised", soft_was=old_soft, soft=limit, hard=hard,
                     note="workers keep the original soft limit")
        self.runtime.acquire()
        listeners = open_listeners(
            cfg.server.bind, [s.slot for s in self.plan.slots], cfg.server.backlog,
            unix_mode=parse_mode(cfg.server.unix_mode), unix_gid=resolve_group(cfg.server.unix_group),
        )
        self.plane.open_admin(cfg)  # a taken port fails the start, before any worker
        self.irq = irqstart.apply_at_start(cfg, self.spawner.topology, self.plan)
        self.spawner.open(listeners)
        self.router.open(listeners, self.spawner.topology)
        self.plane.open(cfg, self.channel, nofile=limit, slots=len(self.table.slots))
        log.info(
            "listening",
            addresses=listeners.addresses(),
            slots=len(self.table.slots),
            runtime_dir=str(self.runtime.path),
            backlog=cfg.server.backlog,
        )

    async def run(self) -> int:
        """Signals in, servers up, every slot spawned; tick until the stop finished; shut down."""
        self._install_signal_handlers()
        topo = self.spawner.topology
        await self.plane.start(self.table.cfg, self, self, self.channel, self.messages, self.heartbeat,
                               topo.cpu_node() if topo is not None else None)
        await self.templates.start()  # [worker] start = "fork": each node's warm template, before any worker
        now = time.monotonic()
        self.router.discovery_allowed = True
        for slot in self.table.slots.values():
            self.table.start_worker(slot, now)
        try:
            while not self._tick(time.monotonic()):
                now = time.monotonic()
                self.channel.hold(self._beats_in(now))
                await self._sleep(self._tick_in(now))
        finally:
            await self._shutdown()
        return self._exit_status()

    def _install_signal_handlers(self) -> None:
        """Handlers only enqueue: set flags, wake the loop, or start an ops request."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self.reloader.on_hup, self)
        loop.add_signal_handler(signal.SIGCHLD, self.table.wake.set)
        loop.set_exception_handler(self._loop_exception)

    def _tick(self, now: float) -> bool:
        """One pass of the supervision loop; True once the stop has finished."""
        self.heartbeat.beat()
        self.channel.drain(self.messages)   # what exited workers said last (Goodbye) is read before their exit is judged
        table = self.table
        table.reap(now)
        self.templates.tick(now)
        if table.stopping:
            if self.stopper.progress():
                return True
        else:
            table.restart_due(now)
            table.check_boot_failure()
            if table.fatal:  # nothing is serving: no balancer to wait for
                self._begin_stop("fatal: " + table.fatal, fast=False, lb_grace=False)
                return self._tick(time.monotonic())
            self._readiness(now)
        self._guard(now)
        self._route(now)
        self._notify(now)
        self._publish_stats(now)
        return False

    def _guard(self, now: float) -> None:
        """Hangs and deadlines, bindings, limits, memory and fds."""
        self.table.watchdog(now)
        self.table.verify(now)
        self.limits.tick(now)
        self.watches.tick(now)

    def _route(self, now: float) -> None:
        """New connections to the serving slots; stranded ones handed over; shared-port watch."""
        self.router.route(now)

    def _settled(self) -> bool:
        """Every slot settled and nothing else in motion (templates, external-command probes)."""
        if self.stopping or self.state not in ("running", "degraded") or self.cmd_ready.tasks:
            return False
        if any(nt.next_start is not None for nt in self.templates.nodes.values()):
            return False
        return all(slot.settled() for slot in self.table.slots.values())

    def _tick_in(self, now: float) -> float:
        """Seconds to the next tick: TICK while anything is in motion; settled, just after the next
        point of the beat grid (``BEAT_SETTLE_S``), at most IDLE_TICK away.

        Settled, the next tick still comes no later than the moment the
        oldest heartbeat would make its worker unresponsive, so leaving
        steering is as prompt as with the short tick.
        """
        if not self._settled():
            return TICK
        oldest = min((s.worker.last_beat for s in self.table.slots.values()  # type: ignore[union-attr]
                      if s.worker is not None and s.worker.last_beat is not None), default=now)
        due = oldest + self.table.unresponsive_after() + 0.005 - now
        wd = self.notifier.watchdog_interval
        limit = min(IDLE_TICK, wd / 4.0) if wd else IDLE_TICK
        return max(0.01, min(limit, due, after_grid(now, self.table.cfg.supervisor.heartbeat_interval,
                                                    BEAT_SETTLE_S)))

    def _beats_in(self, now: float) -> bool:
        """Settled, and every worker's beat of the last grid point has been read: the channel may
        leave the next ones for the tick after the next grid point (``WorkerChannel.hold``).

        A beat that is late (a busy worker, an off-grid beat after a blocked loop) ends the hold,
        so it is read within the coalescing pause and its silence is timed as precisely as before.
        """
        if not self._settled():
            return False
        since = last_grid_point(now, self.table.cfg.supervisor.heartbeat_interval, BEAT_SETTLE_S)
        return all(s.worker is not None and s.worker.last_beat is not None and s.worker.last_beat >= since
                   for s in self.table.slots.values())

    async def _sleep(self, timeout: float = TICK) -> None:
        """Until the next tick (``timeout``), or earlier when SIGCHLD or a message wakes the loop."""
        wake = self.table.wake
        wake.clear()
        try:
            await asyncio.wait_for(wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _shutdown(self) -> None:
        extra = list(self.cmd_ready.tasks.values()) + list(self.reloader.signal_requests) + \
            self.router.tasks() + ([self.stopper.task] if self.stopper.task else [])
        await self.plane.stop(extra)
        await self.router.rescuer.close()
        self.close()

    def _exit_status(self) -> int:
        table = self.table
        if table.fatal:
            return table.exit_code if table.exit_code != EXIT_OK else EXIT_ERROR
        return EXIT_FORCED if table.forced_kills else EXIT_OK

    def close(self) -> None:
        listeners = self.router.listeners
        queued = sum(accept_queue_depth(lst.sock) or 0 for ls in listeners.by_slot.values() for lst in ls)
        if queued:  # closing a listener resets what waits in it: say so
            log.warning("listeners_closed_with_queued_connections", connections=queued)
        for slot in self.table.slots.values():
            for w in slot.workers():
                if w.popen.poll() is None:
                    self.table.signal(w, signal.SIGKILL)
                    try:
                        w.popen.wait(5)
                    except Exception:
                        pass
        self.templates.close()
        listeners.close()
        if self.irq[1] is not None:
            irqstart.restore_at_exit(self.table.cfg, self.irq[1])
            self.irq = (self.irq[0], None)
        self.plane.close(self.channel)
        self.runtime.release()
        self.notifier.close()
        self.plane.end_event_stream()
        if self.router.discovery_allowed:  # a start refused in open() never ran: it did not "stop"
            log.info("stopped", exit_code=EXIT_FORCED if self.table.forced_kills else self.table.exit_code)

    def _readiness(self, now: float) -> None:
        table = self.table
        announced = table.all_ready_logged
        self.state = table.readiness(now, self.state)
        if table.all_ready_logged and not announced:
            # the one line an operator waits for, once every slot serves
            for url in self.router.listeners.urls(tls=table.cfg.tls.enabled):
                log.info(f"serving on {url}", url=url)
        for s in table.slots.values():
            for w in (s.worker, s.incoming):
                if w and w.external and w.ready is None and w.popen.poll() is None:
                    self.cmd_ready.check(s, w, now)

    # ------------------------------------------------------------------- stop

    def _on_stop_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.stopping:
            log.warning("fast_stop", signal=name)
            self._begin_stop(f"second {name}", fast=True)
        else:
            log.info("graceful_stop", signal=name, timeout_s=self.table.cfg.server.graceful_timeout)
            self._begin_stop(name, fast=False)
        self.table.wake.set()

    def request_stop(self, reason: str, fast: bool = False) -> None:
        """OpsTarget: ``numaserve stop`` (``fast``: kill every worker)."""
        self._begin_stop(reason, fast=fast)
        self.table.wake.set()

    def _begin_stop(self, reason: str, *, fast: bool, lb_grace: bool = True) -> None:
        self.state = "stopping"
        self.stopper.begin(reason, fast=fast, lb_grace=lb_grace)

    # --------------------------------------------------------------- report

    def status_line(self) -> str:
        """One-line per-node summary for systemd's STATUS= (and logs)."""
        return status_line(self.state, self.table.slots.values())

    def _notify(self, now: float) -> None:
        n = self.notifier
        if not n.enabled:
            return
        line = self.status_line()
        if self.state in ("running", "degraded") and not n.ready_sent:
            n.ready(line)
        elif line != n.last_line:
            n.status(line)
        if not n.ready_sent and any(s.shown_state() == S.LOADING for s in self.table.slots.values()):
            n.extend_start(now)   # loads judged alive (a stalled one is killed): not cut by TimeoutStartSec
        n.last_line = line
        # WATCHDOG=1 only from this loop and only while it is healthy: the loop
        # ran this tick, and the control channel is alive.
        if n.ping_due(now) and self.channel.sock is not None and self.plane.healthy():
            n.ping(now)

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio reports accept() failing with EMFILE here (and pauses that listener for 1 s)."""
        if not self.plane.note_fd_exhaustion(str(context.get("message") or "accept"), context.get("exception")):
            loop.default_exception_handler(context)

    def status(self) -> dict[str, Any]:
        """OpsTarget / admin: the whole state as one document (``statusview``)."""
        return supervisor_status(self)

    def _publish_stats(self, now: float) -> None:
        if self.plane.stats_wanted(now):
            self.plane.events.publish("stats", topic=b"stats", state=self.state, slots=slot_statuses(self, now))
