"""The supervisor's sockets besides the listeners: worker channel, ops, events, admin, and their bounds.

``open`` binds (before any worker: a taken path or port fails the start):
the worker control ROUTER, the ops ROUTERs (owner, read-only, CURVE TCP),
the event stream's PUB, the front doors in front of the read-only, events
and TCP sockets, with connection caps that fit the fd budget (``fdbudget``).
``start`` serves them; ``stop``/``close`` end them.  The ops gate (CURVE
keys, per-peer rate limit, who is behind a front door) lives here too:
``controlplane`` checks every request against it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any, Callable

import structlog
import zmq
import zmq.asyncio

from numaserve.config import Config
from numaserve.runtime import (
    CONTROL_SOCKET,
    EVENTS_SOCKET,
    OPS_RO_SOCKET,
    OPS_SOCKET,
    RuntimeDir,
    tight_umask,
)
from numaserve.errors import NumaserveError
from numaserve.supervisor import controlplane as cp
from numaserve.supervisor import fdbudget
from numaserve.supervisor.admin import ADMIN_MAX_CONNECTIONS, AdminHandle, LoopHeartbeat, SupervisorView, open_admin_socket, start_admin
from numaserve.supervisor.channel import WorkerChannel, WorkerMessages
from numaserve.supervisor.curvekeys import AuthorizedKeys
from numaserve.supervisor.doorpeers import DoorPeers
from numaserve.supervisor.events import EventStream
from numaserve.supervisor.frontdoor import OPS_IDLE_TIMEOUT, OPS_MAX_CONNECTIONS, FrontDoor, bind_tcp, bind_unix
from numaserve.supervisor.opsapi import OpsTarget
from numaserve.supervisor.opstcp import bind_curve_router
from numaserve.supervisor.ratelimit import PeerRateLimiter

__all__ = ["EVENTS_BACKEND", "OPS_RO_BACKEND", "OPS_TCP_BACKEND", "OpsPlane"]

log = structlog.get_logger("numaserve.supervisor")

OPS_RO_BACKEND = "ops-ro-backend.sock"    # libzmq side of the read-only front door
OPS_TCP_BACKEND = "ops-tcp-backend.sock"  # libzmq (CURVE) side of the TCP front door
EVENTS_BACKEND = "events-backend.sock"    # libzmq PUB behind the events.sock front door


class OpsPlane:
    """Every socket the supervisor serves to operators and workers, and the ops gate (``controlplane.OpsGate``)."""

    def __init__(self, cfg: Config, runtime: RuntimeDir, *, count_bad: Callable[[str, str], None]) -> None:
        self.runtime = runtime
        self.count_bad = count_bad                # malformed or refused requests: counted with the workers' ones
        self.ctx: zmq.asyncio.Context | None = None
        self.ops: zmq.asyncio.Socket | None = None
        self.ops_ro: zmq.asyncio.Socket | None = None
        self.ops_tcp: zmq.asyncio.Socket | None = None
        self.authenticator: Any = None
        self.curve_keys: AuthorizedKeys | None = None   # when ops.tcp_endpoint is set
        self.doors: list[FrontDoor] = []          # the bounded listeners in front of ops-ro, events and ops-tcp
        self.fdwatch: fdbudget.FdWatch | None = None
        self.fd_caps: fdbudget.CapsPlan | None = None
        self.ops_limiter = PeerRateLimiter(cfg.ops.rate_limit, cfg.ops.rate_burst)
        self.door_peers = DoorPeers()             # who is behind each ops-ro front-door connection (rate key)
        self.events = EventStream()
        self.admin: AdminHandle | None = None
        self.admin_sock: socket.socket | None = None   # bound in open(), served from start()
        self.tasks: list[asyncio.Task[Any]] = []
        from numaserve.log import add_event_sink

        add_event_sink(self.events.sink)  # every supervisor log event also goes on the PUB stream

    def open_admin(self, cfg: Config) -> None:
        """Bind the admin port now: a taken port fails the start, before any worker."""
        self.admin_sock = open_admin_socket(cfg.admin)

    def open(self, cfg: Config, channel: WorkerChannel, *, nofile: int, slots: int) -> None:
        """Bind the worker channel, the ops sockets, the event stream and their front doors."""
        self.ctx = zmq.asyncio.Context()
        gid = self.runtime.share_with_group(cfg.ops.readonly_group) if cfg.ops.readonly_group else None
        with tight_umask():
            channel.sock = self._bind(zmq.ROUTER, CONTROL_SOCKET)
            self.ops = self._bind(zmq.ROUTER, OPS_SOCKET)
            self.ops_ro = self._bind(zmq.ROUTER, OPS_RO_BACKEND)
            self.events.pub = self._bind(zmq.PUB, EVENTS_BACKEND)
            ro_sock = bind_unix(str(self.runtime.path / OPS_RO_SOCKET))
            events_sock = bind_unix(str(self.runtime.path / EVENTS_SOCKET))
        if gid is not None:
            self.runtime.open_to_group(OPS_RO_SOCKET, gid)
        tcp_sock = None
        if cfg.ops.tcp_endpoint:
            try:
                with tight_umask():   # remote ops: libzmq's CURVE socket on a private ipc path
                    self.ops_tcp, self.curve_keys, self.authenticator = bind_curve_router(
                        self.ctx, cfg.ops, self.runtime.endpoint(OPS_TCP_BACKEND))
                tcp_sock = bind_tcp(cfg.ops.tcp_endpoint)
            except BaseException:
                ro_sock.close()
                events_sock.close()
                raise
        self._plan_fds(cfg, nofile, slots, ro_sock, events_sock, tcp_sock)

    def _bind(self, kind: int, name: str) -> zmq.asyncio.Socket:
        assert self.ctx is not None
        return cp.bind_socket(self.ctx, kind, self.runtime.endpoint(name))

    def _plan_fds(self, cfg: Config, limit: int, slots: int, ro_sock: socket.socket, events_sock: socket.socket,
                  tcp_sock: socket.socket | None) -> None:
        """Connection caps that fit under the fd limit; the front doors around ops-ro, events and ops-tcp."""
        wanted = {"admin": (ADMIN_MAX_CONNECTIONS if self.admin_sock is not None else 0, 1),
                  "ops-ro": (OPS_MAX_CONNECTIONS, 3),  # client + splice + libzmq's side
                  "events": (OPS_MAX_CONNECTIONS, 3)}
        if tcp_sock is not None:
            wanted["ops-tcp"] = (OPS_MAX_CONNECTIONS, 3)
        baseline = fdbudget.count_open_fds() or 0
        plan = fdbudget.plan_caps(limit, baseline, slots, wanted)
        self.fd_caps = plan
        if plan.scaled:
            log.warning("fd_budget_tight", limit=limit, baseline=baseline, caps=plan.caps, wanted=plan.wanted,
                        fix="raise LimitNOFILE= (systemd) / ulimit -n: connection caps were lowered to fit")
        self.fdwatch = fdbudget.FdWatch(limit=limit)
        idle = OPS_IDLE_TIMEOUT
        path = self.runtime.path
        self.doors.append(FrontDoor("ops-ro", ro_sock, str(path / OPS_RO_BACKEND),
                                    max_connections=plan.caps["ops-ro"], idle_timeout=idle, peers=self.door_peers))
        # a subscriber to rare events is quiet for long: no idle timeout (the cap still evicts quiet ones)
        self.doors.append(FrontDoor("events", events_sock, str(path / EVENTS_BACKEND),
                                    max_connections=plan.caps["events"], idle_timeout=None,
                                    max_client_bytes=cp.EVENTS_CLIENT_BYTES))
        if tcp_sock is not None:
            self.doors.append(FrontDoor("ops-tcp", tcp_sock, str(path / OPS_TCP_BACKEND),
                                        max_connections=plan.caps["ops-tcp"], idle_timeout=idle))

    async def start(self, cfg: Config, target: OpsTarget, view: SupervisorView, channel: WorkerChannel,
                    messages: WorkerMessages, heartbeat: LoopHeartbeat,
                    cpu_node: dict[int, int] | None) -> None:
        """Serve the worker channel, the ops sockets, the front doors and the admin endpoint."""
        self.tasks = [
            asyncio.create_task(channel.serve(messages), name="control"),
            asyncio.create_task(self._serve(target, self.ops, "ipc"), name="ops"),
            asyncio.create_task(self._serve(target, self.ops_ro, "ipc-readonly", readonly=True), name="ops-ro"),
        ]
        if self.ops_tcp is not None:
            self.tasks.append(asyncio.create_task(self._serve(target, self.ops_tcp, "tcp-curve"), name="ops-tcp"))
        for door in self.doors:
            await door.start()
        if self.admin_sock is not None:
            try:
                caps = self.fd_caps.caps if self.fd_caps else {}
                self.admin = await start_admin(view, cfg.admin, sock=self.admin_sock, heartbeat=heartbeat,
                                               cpu_node=cpu_node, max_connections=caps.get("admin"))
            except NumaserveError as e:  # serving matters more than metrics: say so loudly, go on
                log.error("admin_failed", error=str(e))
            self.admin_sock = None

    async def _serve(self, target: OpsTarget, sock: zmq.asyncio.Socket | None, channel: str, *,
                     readonly: bool = False) -> None:
        """Serve one ops socket; bad requests get an error reply, never an exception."""
        assert sock is not None
        await cp.serve_ops(target, self, sock, channel, readonly=readonly)

    def healthy(self) -> bool:
        """The worker channel and the ops loops still run (systemd's WATCHDOG=1 depends on it)."""
        return not any(t.done() for t in self.tasks)

    def reconfigure(self, cfg: Config) -> None:
        """A reload: the per-peer rate limit follows the new config (sockets stay)."""
        self.ops_limiter.rate, self.ops_limiter.burst = cfg.ops.rate_limit, float(cfg.ops.rate_burst)

    def reload_curve_keys(self) -> None:
        """Re-read ``ops.curve_authorized_keys`` (reload, SIGHUP).  A removed key is refused for new
        connections (ZAP) and for every further request on connections it already made."""
        if self.curve_keys is not None:
            self.curve_keys.load()

    def note_fd_exhaustion(self, what: str, exc: BaseException | None) -> bool:
        """EMFILE/ENFILE from accept() or a spawn: counted and logged by the fd watch (True when it was one)."""
        if fdbudget.is_fd_exhaustion(exc) and self.fdwatch is not None:
            self.fdwatch.note_exhaustion(what, exc)
            return True
        return False

    def stats_wanted(self, now: float) -> bool:
        """Once a second, and only while a client is connected to the event stream's front door:
        with 32 workers building every slot's status was ~10 % of the idle supervisor's CPU."""
        if not self.events.stats_due(now):
            return False
        door = next((d for d in self.doors if d.name == "events"), None)
        return door is None or bool(door.conns)

    def status(self) -> dict[str, Any]:
        return {
            "fds": self.fdwatch.status() if self.fdwatch else None,
            "fd_budget": self.fd_caps.to_json() if self.fd_caps else None,
            "front_doors": {d.name: d.status() for d in self.doors},
            "admin_connections": self.admin.connections_status() if self.admin else None,
            "ops_rate_limited": self.ops_limiter.limited,
            "curve_keys": len(self.curve_keys.keys) if self.curve_keys is not None else None,
        }

    async def stop(self, extra: list[asyncio.Task[Any]]) -> None:
        """Cancel the serving tasks (and ``extra``), stop the front doors and the admin endpoint."""
        for t in self.tasks + extra:
            t.cancel()
        await asyncio.gather(*self.tasks, *extra, return_exceptions=True)
        for door in self.doors:
            await door.stop()
        if self.admin is not None:
            await self.admin.stop()
            self.admin = None

    def close(self, channel: WorkerChannel) -> None:
        if self.admin_sock is not None:  # open() failed after binding it
            self.admin_sock.close()
            self.admin_sock = None
        for door in self.doors:
            door.close()
        self.doors = []
        if self.fdwatch is not None:
            self.fdwatch.close()
        for sock in (channel.sock, self.ops, self.ops_ro, self.ops_tcp, self.events.pub):
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

    def end_event_stream(self) -> None:
        from numaserve.log import remove_event_sink

        remove_event_sink(self.events.sink)
