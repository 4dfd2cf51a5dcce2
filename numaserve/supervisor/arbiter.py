"""The supervisor: the composition root that owns the slots, the sockets and the loop.

Shape (gunicorn's arbiter, nginx's master that owns the listeners):

    start:  runtime dir (lock, stale files) → listeners (all slots, before
            any worker) → ZeroMQ sockets → spawn every slot
    loop:   every tick (≤ 0.2 s, woken early by SIGCHLD and messages):
            reap → restart due / readiness → guard (watchdog, verify, limits,
            memory) → route (steer, rescue) → report (systemd, stats)
    stop:   ``stopseq``: readiness off → lb grace → accept queues → Stop → kill

The roles live in their own modules and are composed here: ``lifecycle``
(spawn/reap/backoff/watchdog/verify), ``channel`` (worker control channel),
``events`` (PUB stream), ``stopseq``, ``reload``, ``irqstart``, ``notify``,
``operations`` and the ops verbs (``ops``, ``ops_cache``) through the
``SlotControl``/``OpsTarget`` protocols.  Signal handlers only enqueue (a flag,
a wake-up, or an ops request: SIGHUP is ``reload`` on the audited ops path).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import time
import uuid
from typing import Any, Iterable, Sequence

import structlog
import zmq
import zmq.asyncio

from numaserve.config import Config
from numaserve.control import messages as m
from numaserve.control.peercred import PeerCred
from numaserve.errors import NumaserveError
from numaserve.net.listeners import ListenerSet, accept_queue_depth, open_listeners
from numaserve.net.unixbind import parse_mode, resolve_group
from numaserve.supervisor.doorshed import QueueShed
from numaserve.bind.placement import Plan, SlotPlan
from numaserve.topology.model import Topology
from numaserve.runtime import (
    AUDIT_LOG,
    CONTROL_SOCKET,
    EVENTS_SOCKET,
    OPS_RO_SOCKET,
    OPS_SOCKET,
    PROGRESS_DIR,
    RuntimeDir,
    tight_umask,
)
from numaserve.supervisor import slots as S
from numaserve.supervisor.admin import AdminHandle, LoopHeartbeat, open_admin_socket, start_admin
from numaserve.supervisor import controlplane as cp
from numaserve.supervisor import fdbudget, workerauth
from numaserve.supervisor.audit import AuditLog
from numaserve.supervisor.doorpeers import DoorPeers
from numaserve.supervisor.frontdoor import FrontDoor, bind_tcp, bind_unix
from numaserve.supervisor.ratelimit import PeerRateLimiter
from numaserve.supervisor.backoff import RestartPolicy, RestartState
from numaserve.supervisor.lbgrace import ProbeClock
from numaserve.supervisor.leakwatch import LeakWatch
from numaserve.supervisor.agerecycle import AgeRecycle
from numaserve.supervisor.localitywatch import LocalityWatch
from numaserve.supervisor.lifecycle import (  # noqa: F401  (exit statuses: re-exported)
    EXIT_ERROR,
    EXIT_FORCED,
    EXIT_NO_SLOT,
    EXIT_OK,
    EXIT_USAGE,
    Lifecycle,
)
from numaserve.supervisor.limits import LimitsManager
from numaserve.supervisor.notify import Notifier, status_line
from numaserve.supervisor.operations import Operation, Operations
from numaserve.supervisor.opstcp import bind_curve_router
from numaserve.supervisor import irqstart
from numaserve.supervisor.channel import WorkerChannel
from numaserve.supervisor.workermsgs import WorkerMessageHandler
from numaserve.supervisor.cmdprobe import ExternalReadiness
from numaserve.supervisor.events import EventStream
from numaserve.supervisor.reload import load_for_reload
from numaserve.supervisor.rescue import Rescuer
from numaserve.supervisor.stopseq import ACCEPT_SETTLE_MAX_S, StopSequence  # noqa: F401  (re-exported)
from numaserve.supervisor.steer import Steering, without_fd_limited
from numaserve.supervisor.spawn import spawn
from numaserve.supervisor.templates import TemplateManager

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
OPS_RO_BACKEND = "ops-ro-backend.sock"    # libzmq side of the read-only front door
OPS_TCP_BACKEND = "ops-tcp-backend.sock"  # libzmq (CURVE) side of the TCP front door
EVENTS_BACKEND = "events-backend.sock"    # libzmq PUB behind the events.sock front door


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
        self.cfg = cfg
        self.topology = topology
        self.overrides = overrides or {}
        self.operations = Operations(self)
        self.plan = plan
        self.runtime = runtime
        self.config_path = config_path
        sup = cfg.supervisor
        self.policy = RestartPolicy(
            initial=sup.backoff_initial,
            maximum=sup.backoff_max,
            jitter=sup.backoff_jitter,
            reset_after=sup.backoff_reset_after,
            loop_limit=sup.crash_loop_limit,
            loop_window=sup.crash_loop_window,
            failed_retry=sup.failed_retry_interval,
        )
        self.slots: dict[int, S.SlotState] = {
            p.slot: S.SlotState(plan=p, restart=RestartState(self.policy)) for p in plan.slots
        }
        self.wake = asyncio.Event()
        self.started = time.monotonic()
        self.lifecycle = Lifecycle(cfg, self.slots, self.policy, spawn_worker=self._spawn_process, wake=self.wake,
                                   started=self.started, on_spawn_error=self._note_spawn_error,
                                   on_exit=self._stop_probe)
        self.cmd_ready = ExternalReadiness(self, self.lifecycle, lambda: self.steering, lambda: self.listeners)
        self.limits = LimitsManager(self)
        self.leakwatch = LeakWatch(self, self.operations)
        self.agerecycle = AgeRecycle(self, self.operations)   # worker.max_requests / max_lifetime
        self.locality = LocalityWatch(self, self.operations, self._node_cpus)   # [placement] locality/repair
        self._last_mem = 0.0
        self.listeners = ListenerSet()
        self.steering: Steering | None = None
        self.rescuer = Rescuer()
        self._shared_next = 0.0                             # takeover: next look for other owners
        self._discovery: asyncio.Task[None] | None = None
        self._ran = False
        self._serving_logged = False                        # "serving on URL" written (once, at first all-ready)
        self.irq_status: dict[str, Any] | None = None
        self.irq_state_file: str | None = None
        self.ctx: zmq.asyncio.Context | None = None
        self.ops: zmq.asyncio.Socket | None = None
        self.ops_ro: zmq.asyncio.Socket | None = None
        self.ops_tcp: zmq.asyncio.Socket | None = None
        self.authenticator: Any = None
        self.curve_keys: Any = None               # AuthorizedKeys when ops.tcp_endpoint is set
        self.doors: list[FrontDoor] = []          # the bounded listeners in front of ops-ro and ops-tcp
        self.queue_shed: QueueShed | None = None  # 503s from an overloaded worker's accept queue (doorshed)
        self.fdwatch: fdbudget.FdWatch | None = None
        self.fd_caps: fdbudget.CapsPlan | None = None
        self.ops_limiter = PeerRateLimiter(cfg.ops.rate_limit, cfg.ops.rate_burst)
        self.door_peers = DoorPeers()             # who is behind each ops-ro front-door connection (rate key)
        self.audit = AuditLog(
            __import__("pathlib").Path(cfg.ops.audit_log) if cfg.ops.audit_log else runtime.path / AUDIT_LOG
        )
        self.events = EventStream()
        self._event_sink = self.events.sink
        self.state = "starting"
        self.readyz_probes = ProbeClock()         # the admin app notes every /readyz
        self.channel = WorkerChannel(self.slots)
        self.sticky = self.channel.sticky          # OpsTarget: the cache epoch lives here
        # late-bound: a test may replace _signal on the instance
        self.messages = WorkerMessageHandler(self, self.lifecycle, self.channel, on_hello=self.limits.on_hello,
                                             signal=lambda w, sig: self._signal(w, sig))
        self.notifier = Notifier()
        self.templates = TemplateManager(             # per-node warm templates ([worker] start = "fork")
            self, [p for p in plan.slots], policy=self.policy, notifier=self.notifier, progress_file=self.progress_file,
            gpus=lambda: self.topology.gpus if self.topology else ())
        self.stopper = StopSequence(self, self.lifecycle, self.notifier, self.readyz_probes,
                                    close_listeners=lambda: self.listeners.close())
        from numaserve.log import add_event_sink

        add_event_sink(self._event_sink)  # every supervisor log event also goes on the PUB stream
        self.heartbeat = LoopHeartbeat()          # beaten every loop tick; /healthz reads it
        self.admin: AdminHandle | None = None
        self.admin_sock: Any = None               # bound in open(), served from run()
        self.last_status_line = ""
        self._tasks: list[asyncio.Task[Any]] = []
        self._signal_requests: set[asyncio.Task[Any]] = set()   # SIGHUP's ops requests in flight

    # ------------------------------------------------------------------ start

    def open(self) -> None:
        """Everything that can fail before a worker exists (raises NumaserveError)."""
        old_soft, limit, hard = fdbudget.raise_nofile()
        if limit != old_soft:
            log.info("nofile_raised", soft_was=old_soft, soft=limit, hard=hard,
                     note="workers keep the original soft limit")
        self.runtime.acquire()
        self.listeners = open_listeners(
            self.cfg.server.bind, [s.slot for s in self.plan.slots], self.cfg.server.backlog,
            unix_mode=parse_mode(self.cfg.server.unix_mode), unix_gid=resolve_group(self.cfg.server.unix_group),
        )
        self.queue_shed = QueueShed(str(self.runtime.path), self.cfg.admission, enabled=self._queue_shed_wanted())
        self.admin_sock = open_admin_socket(self.cfg.admin)  # a taken port fails the start, before any worker
        self._apply_irqs()
        from numaserve.supervisor.cmdready import host_port_placeholders

        own = host_port_placeholders(self.cfg.server.cmd) if self.cfg.server.cmd else []
        if own:
            # cmd.allow_host_port: the children bind their own sockets into the
            # group, at positions the supervisor does not know: no program
            log.warning("steering_off", reason="server.cmd binds its own sockets ({" + "}, {".join(own) + "})")
        else:
            self.steering = Steering(
                self.listeners,
                mode=self.cfg.server.steering,
                cpu_node=self.topology.cpu_node() if self.topology else {},
                slot_node={s.slot: s.node for s in self.plan.slots},
                node_cpus=self._crowd_cpus(),
                max_connections=self.cfg.server.max_connections,
                slot_cpus={s.slot: s.cpus for s in self.plan.slots},
            )
            self._check_shared_port(time.monotonic())
        self.ctx = zmq.asyncio.Context()
        gid = self.runtime.share_with_group(self.cfg.ops.readonly_group) if self.cfg.ops.readonly_group else None
        with tight_umask():
            self.channel.sock = self._bind(zmq.ROUTER, CONTROL_SOCKET)
            self.ops = self._bind(zmq.ROUTER, OPS_SOCKET)
            self.ops_ro = self._bind(zmq.ROUTER, OPS_RO_BACKEND)
            self.events.pub = self._bind(zmq.PUB, EVENTS_BACKEND)
            ro_sock = bind_unix(str(self.runtime.path / OPS_RO_SOCKET))
            events_sock = bind_unix(str(self.runtime.path / EVENTS_SOCKET))
        if gid is not None:
            self.runtime.open_to_group(OPS_RO_SOCKET, gid)
        tcp_sock = None
        if self.cfg.ops.tcp_endpoint:
            try:
                self.ops_tcp = self._bind_curve_tcp()
                tcp_sock = bind_tcp(self.cfg.ops.tcp_endpoint)
            except BaseException:
                ro_sock.close()
                events_sock.close()
                raise
        self._plan_fds(limit, ro_sock, events_sock, tcp_sock)
        log.info(
            "listening",
            addresses=self.listeners.addresses(),
            slots=len(self.slots),
            runtime_dir=str(self.runtime.path),
            backlog=self.cfg.server.backlog,
        )

    def _apply_irqs(self) -> None:
        self.irq_status, self.irq_state_file = irqstart.apply_at_start(self.cfg, self.topology, self.plan)

    def _restore_irqs(self) -> None:
        if self.irq_state_file is not None:
            irqstart.restore_at_exit(self.cfg, self.irq_state_file)
            self.irq_state_file = None

    def _bind(self, kind: int, name: str) -> zmq.asyncio.Socket:
        assert self.ctx is not None
        return cp.bind_socket(self.ctx, kind, self.runtime.endpoint(name))

    def _plan_fds(self, limit: int, ro_sock: Any, events_sock: Any, tcp_sock: Any) -> None:
        """Connection caps that fit under the fd limit; the front doors around ops-ro, events and ops-tcp."""
        wanted = {"admin": (self.cfg.admin.max_connections if self.admin_sock is not None else 0, 1),
                  "ops-ro": (self.cfg.ops.max_connections, 3),  # client + splice + libzmq's side
                  "events": (self.cfg.ops.max_connections, 3)}
        if tcp_sock is not None:
            wanted["ops-tcp"] = (self.cfg.ops.max_connections, 3)
        baseline = fdbudget.count_open_fds() or 0
        plan = fdbudget.plan_caps(limit, baseline, len(self.slots), wanted)
        self.fd_caps = plan
        if plan.scaled:
            log.warning("fd_budget_tight", limit=limit, baseline=baseline, caps=plan.caps, wanted=plan.wanted,
                        fix="raise LimitNOFILE= (systemd) / ulimit -n: connection caps were lowered to fit")
        self.fdwatch = fdbudget.FdWatch(limit=limit)
        idle = self.cfg.ops.idle_timeout
        self.doors.append(FrontDoor("ops-ro", ro_sock, str(self.runtime.path / OPS_RO_BACKEND),
                                    max_connections=plan.caps["ops-ro"], idle_timeout=idle, peers=self.door_peers))
        # a subscriber to rare events is quiet for long: no idle timeout (the cap still evicts quiet ones)
        self.doors.append(FrontDoor("events", events_sock, str(self.runtime.path / EVENTS_BACKEND),
                                    max_connections=plan.caps["events"], idle_timeout=None,
                                    max_client_bytes=cp.EVENTS_CLIENT_BYTES))
        if tcp_sock is not None:
            self.doors.append(FrontDoor("ops-tcp", tcp_sock, str(self.runtime.path / OPS_TCP_BACKEND),
                                        max_connections=plan.caps["ops-tcp"], idle_timeout=idle))

    def _bind_curve_tcp(self) -> zmq.asyncio.Socket:
        """Remote ops over TCP: libzmq's CURVE socket on a private ipc path (the TCP FrontDoor splices to it)."""
        assert self.ctx is not None
        with tight_umask():
            sock, self.curve_keys, self.authenticator = bind_curve_router(
                self.ctx, self.cfg.ops, self.runtime.endpoint(OPS_TCP_BACKEND))
        return sock

    def reload_curve_keys(self) -> None:
        """Re-read ``ops.curve_authorized_keys`` (reload, SIGHUP).  A removed key is refused for new
        connections (ZAP) and for every further request on connections it already made."""
        if self.curve_keys is not None:
            self.curve_keys.load()

    async def run(self) -> int:
        """Signals in, servers up, every slot spawned; tick until the stop finished; shut down."""
        self._install_signal_handlers()
        await self._start_servers()
        await self.templates.start()  # [worker] start = "fork": each node's warm template, before any worker
        self._spawn_all()
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
        loop.add_signal_handler(signal.SIGHUP, self._on_hup)
        loop.add_signal_handler(signal.SIGCHLD, self.wake.set)
        loop.set_exception_handler(self._loop_exception)

    async def _start_servers(self) -> None:
        """The worker channel, the ops sockets, the front doors and the admin endpoint."""
        self._tasks = [
            asyncio.create_task(self._control_loop(), name="control"),
            asyncio.create_task(self._ops_loop(self.ops, "ipc"), name="ops"),
            asyncio.create_task(self._ops_loop(self.ops_ro, "ipc-readonly", readonly=True), name="ops-ro"),
        ]
        if self.ops_tcp is not None:
            self._tasks.append(asyncio.create_task(self._ops_loop(self.ops_tcp, "tcp-curve"), name="ops-tcp"))
        for door in self.doors:
            await door.start()
        if self.admin_sock is not None:
            try:
                caps = self.fd_caps.caps if self.fd_caps else {}
                self.admin = await start_admin(self, self.cfg.admin, sock=self.admin_sock,
                                               max_connections=caps.get("admin"))
            except NumaserveError as e:  # serving matters more than metrics: say so loudly, go on
                log.error("admin_failed", error=str(e))
            self.admin_sock = None

    def _spawn_all(self) -> None:
        now = time.monotonic()
        self._ran = True
        for slot in self.slots.values():
            self.start_worker(slot, now)

    def _tick(self, now: float) -> bool:
        """One pass of the supervision loop; True once the stop has finished."""
        self.heartbeat.beat()
        self.channel.drain(self)   # what exited workers said last (Goodbye) is read before their exit is judged
        self.lifecycle.reap(now)
        self.templates.tick(now)
        if self.stopping:
            if self.stopper.progress():
                return True
        else:
            self.lifecycle.restart_due(now)
            self.lifecycle.check_boot_failure()
            if self.fatal:  # nothing is serving: no balancer to wait for
                self._begin_stop("fatal: " + self.fatal, fast=False, lb_grace=False)
                return self._tick(time.monotonic())
            self._readiness(now)
        self._guard(now)
        self._route(now)
        self._report(now)
        return False

    def _guard(self, now: float) -> None:
        """Hangs and deadlines, bindings, limits, memory and fds."""
        self.lifecycle.watchdog(now)
        self.lifecycle.verify(now)
        self.limits.tick(now)
        if now - self._last_mem >= 0.9:   # once a second (settled ticks are 1 s apart, give or take)
            self._last_mem = now
            self.leakwatch.tick(now)
            self.agerecycle.tick(now)
            self.locality.tick(now)
            if self.fdwatch is not None:
                self.fdwatch.tick()

    def _route(self, now: float) -> None:
        """New connections to the serving slots; stranded ones handed over; shared-port watch."""
        self.steer()
        self._rescue()
        self._check_shared_port(now)
        if self.queue_shed is not None and not self.stopping:
            self.queue_shed.tick(self.slots, {n: [lst.sock for lst in ls] for n, ls in self.listeners.by_slot.items()},
                                 self.cfg.admission)
        elif self.queue_shed is not None:
            self.queue_shed.tick({}, {}, self.cfg.admission)

    def _queue_shed_wanted(self) -> bool:
        """The supervisor answers overload 503s only for plain-HTTP numaserve workers with the "cpu" gate."""
        a = self.cfg.admission
        tls = getattr(self.cfg, "tls", None)
        return bool(a.enabled and a.limiter == "cpu" and a.supervisor_shed and not self.cfg.server.cmd
                    and not (tls is not None and tls.enabled))

    def _report(self, now: float) -> None:
        self._notify(now)
        self._publish_stats(now)

    def _settled(self) -> bool:
        """Every slot settled and nothing else in motion (templates, external-command probes)."""
        if self.stopping or self.state not in ("running", "degraded") or self.cmd_ready.tasks:
            return False
        if any(nt.next_start is not None for nt in self.templates.nodes.values()):
            return False
        return all(slot.settled() for slot in self.slots.values())

    def _tick_in(self, now: float) -> float:
        """Seconds to the next tick: TICK while anything is in motion; settled, just after the next
        point of the beat grid (``BEAT_SETTLE_S``), at most IDLE_TICK away.

        Settled, the next tick still comes no later than the moment the
        oldest heartbeat would make its worker unresponsive, so leaving
        steering is as prompt as with the short tick.
        """
        if not self._settled():
            return TICK
        oldest = min((s.worker.last_beat for s in self.slots.values()  # type: ignore[union-attr]
                      if s.worker is not None and s.worker.last_beat is not None), default=now)
        due = oldest + self.unresponsive_after() + 0.005 - now
        wd = self.notifier.watchdog_interval
        limit = min(IDLE_TICK, wd / 4.0) if wd else IDLE_TICK
        return max(0.01, min(limit, due, after_grid(now, self.cfg.supervisor.heartbeat_interval, BEAT_SETTLE_S)))

    def _beats_in(self, now: float) -> bool:
        """Settled, and every worker's beat of the last grid point has been read: the channel may
        leave the next ones for the tick after the next grid point (``WorkerChannel.hold``).

        A beat that is late (a busy worker, an off-grid beat after a blocked loop) ends the hold,
        so it is read within the coalescing pause and its silence is timed as precisely as before.
        """
        if not self._settled():
            return False
        since = last_grid_point(now, self.cfg.supervisor.heartbeat_interval, BEAT_SETTLE_S)
        return all(s.worker is not None and s.worker.last_beat is not None and s.worker.last_beat >= since
                   for s in self.slots.values())

    async def _sleep(self, timeout: float = TICK) -> None:
        """Until the next tick (``timeout``), or earlier when SIGCHLD or a message wakes the loop."""
        self.wake.clear()
        try:
            await asyncio.wait_for(self.wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def _shutdown(self) -> None:
        extra = list(self.cmd_ready.tasks.values()) + list(self._signal_requests) + \
            ([self._discovery] if self._discovery else []) + ([self.stopper.task] if self.stopper.task else [])
        for t in self._tasks + extra:
            t.cancel()
        await asyncio.gather(*self._tasks, *extra, return_exceptions=True)
        await self.rescuer.close()
        for door in self.doors:
            await door.stop()
        if self.admin is not None:
            await self.admin.stop()
            self.admin = None
        self.close()

    def _exit_status(self) -> int:
        if self.fatal:
            return self.exit_code if self.exit_code != EXIT_OK else EXIT_ERROR
        return EXIT_FORCED if self.forced_kills else EXIT_OK

    def close(self) -> None:
        queued = sum(accept_queue_depth(lst.sock) or 0 for ls in self.listeners.by_slot.values() for lst in ls)
        if queued:  # closing a listener resets what waits in it: say so
            log.warning("listeners_closed_with_queued_connections", connections=queued)
        for slot in self.slots.values():
            for w in slot.workers():
                if w.popen.poll() is None:
                    self._signal(w, signal.SIGKILL)
                    try:
                        w.popen.wait(5)
                    except Exception:
                        pass
        self.templates.close()
        if self.queue_shed is not None:
            self.queue_shed.close()
        self.listeners.close()
        if self.admin_sock is not None:  # open() failed after binding it
            self.admin_sock.close()
            self.admin_sock = None
        self._restore_irqs()
        for door in self.doors:
            door.close()
        self.doors = []
        if self.fdwatch is not None:
            self.fdwatch.close()
        for sock in (self.channel.sock, self.ops, self.ops_ro, self.ops_tcp, self.events.pub):
            if sock is not None:
                sock.close(0)
        if self.authenticator is not None:
            self.authenticator.stop()
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        if self.runtime.lock_fd is not None:  # ours: the libzmq sides of the front doors
            for name in (OPS_RO_BACKEND, OPS_TCP_BACKEND, EVENTS_BACKEND):
                with contextlib.suppress(OSError):
                    (self.runtime.path / name).unlink()
        self.runtime.release()
        self.notifier.close()
        from numaserve.log import remove_event_sink

        remove_event_sink(self._event_sink)
        if self._ran:  # a start refused in open() never ran: it did not "stop"
            log.info("stopped", exit_code=EXIT_FORCED if self.forced_kills else self.exit_code)

    # ---------------------------------------------------------------- workers

    def _spawn_process(self, plan: SlotPlan, generation: int, now: float) -> S.WorkerProc:
        """The spawn seam: one slot plan + generation -> a running, bound worker (raises OSError/NumaserveError)."""
        fds = self.listeners.for_slot(plan.slot)
        self.channel.hold(False)   # a new worker's Hello and Ready are read as they come, not at the next tick
        token = workerauth.new_token()
        progress = self.progress_file(f"slot{plan.slot}-gen{generation}")
        popen, external, env = spawn(
            self.cfg, plan, generation, fds, self.runtime.endpoint(CONTROL_SOCKET),
            all_gpus=self.topology.gpus if self.topology else (),
            node_cpus=self._node_cpus(plan.node), token=token, forker=self.templates.forker(),
            gate_page=self.queue_shed.page_for(plan.slot) if self.queue_shed is not None else "",
            progress_file=progress,
        )
        w = S.WorkerProc(generation=generation, popen=popen, started=now, external=external, env=env,
                         token=None if external else token, progress_path=None if external else progress)
        log.info(
            "spawn",
            slot=plan.slot,
            node=plan.node,
            generation=generation,
            pid=popen.pid,
            cpus=list(plan.cpus),
            mempolicy=plan.mempolicy,
            memory_nodes=list(plan.memory_nodes),
            external=external,
            start=TemplateManager.worker_start(popen)["mode"],
        )
        return w

    def progress_file(self, name: str) -> str:
        """A loading process's ``numaserve.progress`` file, in the runtime directory's ``progress/``."""
        d = self.runtime.path / PROGRESS_DIR
        d.mkdir(mode=0o700, exist_ok=True)
        path = d / f"{name}.json"
        path.unlink(missing_ok=True)  # a file left by an earlier supervisor must not look like progress
        return str(path)

    def _note_spawn_error(self, e: BaseException) -> None:
        if fdbudget.is_fd_exhaustion(e) and self.fdwatch is not None:
            self.fdwatch.note_exhaustion("spawn", e)

    def _node_cpus(self, node: int) -> tuple[int, ...]:
        if self.topology is None:
            return ()
        try:
            return self.topology.node(node).cpus
        except KeyError:
            return ()

    # SlotControl: what operations, the leak watch and the limits manager may do to slots

    def start_worker(self, slot: S.SlotState, now: float) -> None:
        self.lifecycle.start_worker(slot, now)

    def spawn_generation(self, slot: S.SlotState, now: float) -> S.WorkerProc:
        return self.lifecycle.spawn_generation(slot, now)

    def mark_ready(self, slot: S.SlotState, now: float) -> None:
        self.lifecycle.mark_ready(slot, now)

    def kill(self, w: S.WorkerProc, now: float) -> None:
        self.lifecycle.kill(w, now)

    def _signal(self, w: S.WorkerProc, sig: int) -> None:
        self.lifecycle.signal(w, sig)

    def unresponsive_after(self) -> float:
        return self.lifecycle.unresponsive_after()

    # the loop's state lives in the lifecycle; these keep the supervisor's names
    stopping = property(lambda self: self.lifecycle.stopping)
    forced_kills = property(lambda self: self.lifecycle.forced_kills)
    fatal = property(lambda self: self.lifecycle.fatal)
    exit_code = property(lambda self: self.lifecycle.exit_code)

    def _readiness(self, now: float) -> None:
        self.state = self.lifecycle.readiness(now, self.state)
        if self.lifecycle.all_ready_logged and not self._serving_logged:
            self._serving_logged = True   # the one line an operator waits for, once every slot serves
            for url in self.listeners.urls(tls=self.cfg.tls.enabled):
                log.info(f"serving on {url}", url=url)
        slots = list(self.slots.values())
        for s in slots:
            for w in (s.worker, s.incoming):
                if w and w.external and w.ready is None and w.popen.poll() is None:
                    self.cmd_ready.check(s, w, now)

    # ---------------------------------------------------------------- control

    def _stop_probe(self, w: S.WorkerProc) -> None:
        self.cmd_ready.stop(w)

    async def _control_loop(self) -> None:
        await self.channel.serve(self)

    def count_bad(self, channel: str, why: str) -> None:
        """A malformed, unknown or refused message: counted (status: bad_messages) and dropped."""
        self.messages.count_bad(channel, why)

    def handle_worker_msg(self, identity: bytes, msg: m.WorkerToSupervisor, peer: PeerCred | None = None) -> None:
        self.messages.handle_worker_msg(identity, msg, peer)

    bad_messages = property(lambda self: self.messages.bad_messages)
    rejected = property(lambda self: self.messages.rejected)

    async def broadcast_one(self, w: S.WorkerProc, name: str, args: dict[str, Any], *,
                            timeout: float = 5.0) -> dict[str, Any]:
        return await self.channel.broadcast_one(w, name, args, timeout=timeout)

    async def command_each(self, targets: Sequence[tuple[int, S.WorkerProc, dict[str, Any]]], name: str, *,
                           timeout: float = 5.0) -> list[dict[str, Any]]:
        return await self.channel.command_each(targets, name, timeout=timeout)

    def send_command(self, w: S.WorkerProc, name: str, args: dict[str, Any]) -> None:
        self.channel.send_command(w, name, args)

    async def broadcast(self, name: str, args: dict[str, Any], *, timeout: float = 5.0,
                        sticky: bool = False) -> dict[str, Any]:
        return await self.channel.broadcast(name, args, timeout=timeout, sticky=sticky)

    def publish(self, event: str, *, topic: bytes = b"event", **fields: Any) -> None:
        self.events.publish(event, topic=topic, **fields)

    def _publish_stats(self, now: float) -> None:
        # every slot's status, once a second: built only while someone is connected to the
        # event stream (with 32 workers it was ~10 % of the idle supervisor's CPU)
        if self.events.stats_due(now) and self._events_listened():
            self.publish("stats", topic=b"stats", state=self.state, slots=self.slot_statuses(now))

    def _events_listened(self) -> bool:
        """Whether a client is connected to the event stream's front door (True without one)."""
        door = next((d for d in self.doors if d.name == "events"), None)
        return door is None or bool(door.conns)

    def slot_statuses(self, now: float) -> list[dict[str, Any]]:
        out = []
        for slot in self.slots.values():
            d = slot.status(now)
            st = slot.worker.stats if slot.worker else None
            d["queued"] = st.queued if st else 0
            d["shed"] = st.shed if st else 0
            d["limits"] = self.limits.status(slot)
            d["memory"] = self.leakwatch.status(slot)
            d["locality"] = self.locality.status(slot)
            extra = st.extra if st else {}
            d["condition"] = "degraded (fd limit)" if extra.get("fd_limited") else None
            d["fds"] = ({k: extra.get(k) for k in ("fds_open", "fd_limit", "accept_errors", "fd_limit_hits")}
                        if "fd_limit" in extra else None)
            d["control_refused"] = self.rejected.get(slot.plan.slot, 0)
            d["start"] = TemplateManager.worker_start(slot.worker.popen) if slot.worker else None
            if slot.state == S.STARTING and slot.worker is None:   # waiting on its node's template
                tmpl = self.templates.loading(slot.plan.node, now)
                if tmpl is not None:
                    d["state"], d["loading"] = S.LOADING, tmpl
            out.append(d)
        return out

    # ------------------------------------------------------------------- stop

    def _on_stop_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.stopping:
            log.warning("fast_stop", signal=name)
            self._begin_stop(f"second {name}", fast=True)
        else:
            log.info("graceful_stop", signal=name, timeout_s=self.cfg.server.graceful_timeout)
            self._begin_stop(name, fast=False)
        self.wake.set()

    def request_stop(self, reason: str, fast: bool = False) -> None:
        self._begin_stop(reason, fast=fast)
        self.wake.set()

    def _begin_stop(self, reason: str, *, fast: bool, lb_grace: bool = True) -> None:
        self.state = "stopping"
        self.stopper.begin(reason, fast=fast, lb_grace=lb_grace)

    def send_stop(self, slot: S.SlotState, w: S.WorkerProc, now: float, deadline: float, *, drain: bool) -> None:
        """Ask one worker to finish in-flight work within ``deadline`` s and exit.

        ``drain``: Drain (it stops accepting at once) rather than Stop; both end
        with the worker exiting. External commands get SIGTERM.
        """
        if w.stop_sent is not None:
            return
        w.stop_sent = now
        w.stop_deadline = deadline
        if w.identity is not None and not w.external:
            msg: m.Msg = (m.Drain if drain else m.Stop)(id=uuid.uuid4().hex[:12], deadline=deadline)
            self.channel.send_soon(w, msg)
        elif w.external or w.hello is None:
            # no control channel (yet): an external command, or a worker still booting
            self._signal(w, signal.SIGTERM)

    def queued(self, slots: Iterable[int]) -> int:
        """Connections waiting in these slots' listeners (SlotControl)."""
        return sum(accept_queue_depth(lst.sock) or 0 for n in slots for lst in self.listeners.by_slot.get(n, []))

    def healthy_slots(self) -> list[int]:
        """Slots that should receive new connections: a worker is serving there
        and answering (heartbeats no older than ``unresponsive_after``)."""
        return [s.plan.slot for s in self.slots.values() if s.state == S.READY and not s.drained
                and not (s.worker is not None and s.worker.unresponsive_since is not None)]

    def _steering_status(self) -> dict[str, Any] | None:
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
        if self.steering is not None and (not self.stopping or self.stopper.phase == "lb_grace"):
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

    def _crowd_cpus(self) -> dict[int, int]:
        """node -> CPUs its workers run on, for the steering hot set (empty: ``server.concentrate`` off)."""
        if not self.cfg.server.concentrate:
            return {}
        cpus: dict[int, set[int]] = {}
        for s in self.plan.slots:
            cpus.setdefault(s.node, set()).update(s.cpus)
        return {n: len(c) for n, c in cpus.items()}

    def _check_shared_port(self, now: float) -> None:
        """``server.takeover``: no program while another owner shares a group;
        once it left, measure where our sockets sit, then steer again."""
        st = self.steering
        if st is None or not self.cfg.server.takeover or now < self._shared_next:
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
        if st.paused is not None and (self._discovery is None or self._discovery.done()) and self._ran:
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

    def _rescue(self) -> None:
        """Hand connections stranded on a non-serving slot to a serving one."""
        st = self.steering
        if st is None or self.stopping or not st.attached or not st.healthy:
            return
        healthy = set(st.healthy)
        stranded = [(sid, lst) for sid in self.stranded_slots() if sid not in healthy
                    for lst in self.listeners.by_slot.get(sid, [])]
        if stranded:
            self.rescuer.tick(stranded)

    # ----------------------------------------------------------------- reload

    def _on_hup(self) -> None:
        """SIGHUP is a ``reload`` ops request (trigger "SIGHUP", as before): same path, same audit line as ``numaserve reload``."""
        from numaserve.supervisor.ops import handle_ops_request

        req = m.OpsRequest(verb="reload", args={"trigger": "SIGHUP"}, id=f"sighup-{uuid.uuid4().hex[:8]}")
        log.info("reload_requested", signal="SIGHUP", request=req.id)
        task = asyncio.get_running_loop().create_task(
            handle_ops_request(self, req, channel="signal", who={"signal": "SIGHUP"}), name="sighup")
        self._signal_requests.add(task)
        task.add_done_callback(self._signal_requests.discard)

    def start_reload(self, args: dict[str, Any]) -> Operation:
        """Re-read the config (same file, same flags), check it changes nothing that
        needs new listeners or a new plan, then roll every slot onto it.

        systemd: RELOADING=1 before the re-read (MONOTONIC_USEC = when it was asked,
        as Type=notify-reload checks), READY=1 when the roll ends or the reload is
        refused.  A refusal *because a reload is running* sends neither: that
        reload's READY=1 is what ends systemd's "reloading".
        """
        busy = self._reload_running()
        if not busy:
            self.notifier.reloading()
        try:
            return self._start_reload(args)
        except NumaserveError as e:
            log.error("reload_refused", trigger=args.get("trigger", "ops"), reason=str(e))
            if not busy:
                self.notifier.reload_done(f"{self.status_line()} (reload refused: {e})")
            raise

    def _reload_running(self) -> bool:
        cur = self.operations.current
        return cur is not None and cur.kind == "reload" and cur.state == "running"

    def _start_reload(self, args: dict[str, Any]) -> Operation:
        from numaserve.supervisor.ops import arg_timeout

        timeout_arg = arg_timeout(args, "timeout", None)
        # a revoked key must stop working even when the rest of the reload is refused
        self.reload_curve_keys()
        new_cfg, topo, _ = load_for_reload(self.config_path, self.overrides, self.cfg, self.plan)
        timeout = new_cfg.ops.drain_timeout if timeout_arg is None else timeout_arg
        slots = list(self.slots.values())

        async def body(op: Operation) -> str:
            why = await self.templates.reload(new_cfg, op)  # make-before-break: old templates kept on failure
            if why:
                from numaserve.supervisor.operations import OperationFailed

                self.notifier.reload_done(self.status_line())
                raise OperationFailed(f"new app code failed to load, nothing rolled: {why}")
            self.cfg = new_cfg
            self.topology = topo
            self.ops_limiter.rate, self.ops_limiter.burst = new_cfg.ops.rate_limit, float(new_cfg.ops.rate_burst)
            for door in self.doors:
                if door.idle_timeout is not None:
                    door.idle_timeout = new_cfg.ops.idle_timeout
            if self.steering is not None and self.steering.mode != new_cfg.server.steering:
                self.steering.mode = new_cfg.server.steering
                self.steering.healthy = None  # force a reattach
            if self.steering is not None:
                self.steering.set_crowd(self._crowd_cpus(), new_cfg.server.max_connections)
            op.step("config re-read", config=self.config_path or "(defaults)")
            try:
                return await self.operations.roll(op, slots, timeout, new_cfg.ops.reload_parallel)
            finally:
                self.notifier.reload_done(self.status_line())

        return self.operations.start("reload", args, [s.plan.slot for s in slots], body)

    # ---------------------------------------------------------------- systemd

    def status_line(self) -> str:
        """One-line per-node summary for systemd's STATUS= (and logs)."""
        return status_line(self.state, self.slots.values())

    def _notify(self, now: float) -> None:
        n = self.notifier
        if not n.enabled:
            return
        line = self.status_line()
        if self.state in ("running", "degraded") and not n.ready_sent:
            n.ready(line)
        elif line != self.last_status_line:
            n.status(line)
        if not n.ready_sent and any(s.shown_state() == S.LOADING for s in self.slots.values()):
            n.extend_start(now)   # loads judged alive (a stalled one is killed): not cut by TimeoutStartSec
        self.last_status_line = line
        # WATCHDOG=1 only from this loop and only while it is healthy: the loop
        # ran this tick, and the control channel is alive.
        if n.ping_due(now) and self._healthy():
            n.ping(now)

    def _healthy(self) -> bool:
        return self.channel.sock is not None and not any(t.done() for t in self._tasks)

    # -------------------------------------------------------------------- ops

    async def _ops_loop(self, sock: zmq.asyncio.Socket | None, channel: str, *, readonly: bool = False) -> None:
        """Serve one ops socket; bad requests get an error reply, never an exception."""
        assert sock is not None
        await cp.serve_ops(self, sock, channel, readonly=readonly)

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio reports accept() failing with EMFILE here (and pauses that listener for 1 s)."""
        exc = context.get("exception")
        if fdbudget.is_fd_exhaustion(exc) and self.fdwatch is not None:
            self.fdwatch.note_exhaustion(str(context.get("message") or "accept"), exc)
            return
        loop.default_exception_handler(context)

    def _control_plane_status(self) -> dict[str, Any]:
        return {
            "fds": self.fdwatch.status() if self.fdwatch else None,
            "fd_budget": self.fd_caps.to_json() if self.fd_caps else None,
            "front_doors": {d.name: d.status() for d in self.doors},
            "admin_connections": self.admin.connections_status() if self.admin else None,
            "ops_rate_limited": self.ops_limiter.limited,
            "curve_keys": len(self.curve_keys.keys) if self.curve_keys is not None else None,
            "audit": self.audit.status(),
        }

    def status(self) -> dict[str, Any]:
        # what workers (and anyone else) sent is read first: while every slot is settled the channel
        # leaves messages queued until the next tick (``WorkerChannel.hold``), and a status is a snapshot
        # of now (heartbeat ages, counters, bad_messages), not of the last tick
        self.channel.drain(self)
        now = time.monotonic()
        return {
            "supervisor": {
                "pid": os.getpid(),
                "state": self.state,
                "stop_phase": self.stopper.phase,
                "lb_grace_left_s": (round(max(0.0, self.stopper.lb_grace_until - now), 3)
                                    if self.stopper.phase == "lb_grace" and self.stopper.lb_grace_until else None),
                "uptime_s": round(now - self.started, 3),
                "runtime_dir": str(self.runtime.path),
                "config_file": self.config_path,
                "listeners": self.listeners.addresses(),
                "queue_shed": self.queue_shed.status() if self.queue_shed is not None else None,
                "accept_queue": {
                    str(slot): [accept_queue_depth(lst.sock) for lst in ls]
                    for slot, ls in self.listeners.by_slot.items()
                },
                "bad_messages": self.bad_messages,
                "control_plane": self._control_plane_status(),
                "steering": self._steering_status(),
                "rescue": self.rescuer.status(),
                "locality": self.locality.summary(),
                "admin": self.admin.address if self.admin else None,
                "irq": self.irq_status,
                "app": self.cfg.server.app or ("" if self.cfg.server.cmd else "numaserve.apps.demo:app"),
                "cmd": self.cfg.server.cmd,
            },
            "plan": {"skipped": [{"node": s.node, "reason": s.reason} for s in self.plan.skipped],
                     "notes": list(self.plan.notes)},
            "slots": self.slot_statuses(now),
            "limits": {str(n): d for n, d in self.limits.last_decision.items()},
            "templates": self.templates.status(),
            "operations": self.operations.recent(),
        }
