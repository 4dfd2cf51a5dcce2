"""Reload: re-read the config under the same flags, decide whether it can apply in place, roll it.

Listeners and the placement plan are fixed for the supervisor's life (they
define the reuseport groups and the bindings); anything else rolls onto the
slots through a tracked ``reload`` operation (make before break).  A config
that cannot apply is refused with every reason, and nothing changes.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Callable

import structlog

from numaserve.config import Config, load_config
from numaserve.control import messages as m
from numaserve.errors import NumaserveError
from numaserve.bind.placement import Plan
from numaserve.cmdready import host_port_placeholders
from numaserve.supervisor.notify import Notifier
from numaserve.supervisor.operations import Operation, OperationFailed, Operations
from numaserve.supervisor.opsapi import OpsTarget, arg_timeout
from numaserve.supervisor.opsplane import OpsPlane
from numaserve.supervisor.prepare import prepare
from numaserve.supervisor.routing import Router
from numaserve.supervisor.slottable import SlotTable
from numaserve.supervisor.spawner import Spawner
from numaserve.supervisor.templates import TemplateManager
from numaserve.topology.model import Topology

__all__ = ["Reloader", "load_for_reload", "reload_blockers"]

log = structlog.get_logger("numaserve.supervisor")


def load_for_reload(config_path: str | None, overrides: dict[str, dict[str, Any]], old: Config,
                    old_plan: Plan) -> tuple[Config, Topology, Plan]:
    """The new config, topology and plan, or NumaserveError("reload refused, nothing changed: ...")."""
    try:
        new_cfg = load_config(config_path, overrides)
        topo, new_plan = prepare(new_cfg)
    except NumaserveError as e:
        raise NumaserveError(f"reload refused, nothing changed: {e}") from None
    problems = reload_blockers(old, old_plan, new_cfg, new_plan)
    if problems:
        raise NumaserveError(
            "reload refused, nothing changed: " + "; ".join(problems)
            + " (these need a restart of the service)"
        )
    return new_cfg, topo, new_plan


def reload_blockers(old: Config, old_plan: Plan, new: Config, new_plan: Plan) -> list[str]:
    """What a reload cannot apply in place (listeners and the plan are fixed for
    the supervisor's life: they define the reuseport groups and bindings)."""
    out = []
    if sorted(old.server.bind) != sorted(new.server.bind):
        out.append(f"server.bind changed ({old.server.bind} -> {new.server.bind})")
    if old.server.backlog != new.server.backlog:
        out.append(f"server.backlog changed ({old.server.backlog} -> {new.server.backlog})")
    for key in ("unix_mode", "unix_group"):   # set on the unix socket file when it is created
        if any(b.startswith("unix:") for b in new.server.bind) and getattr(old.server, key) != getattr(new.server, key):
            out.append(f"server.{key} changed ({getattr(old.server, key)!r} -> {getattr(new.server, key)!r})")
    if bool(old.server.cmd) != bool(new.server.cmd):
        out.append("switching between server.app and server.cmd")
    if bool(host_port_placeholders(old.server.cmd)) != bool(host_port_placeholders(new.server.cmd)):
        out.append("server.cmd switched to or from binding its own sockets ({host}/{port})")
    a = [(s.slot, s.node, s.cpus, s.mempolicy, s.memory_nodes) for s in old_plan.slots]
    b = [(s.slot, s.node, s.cpus, s.mempolicy, s.memory_nodes) for s in new_plan.slots]
    if a != b:
        out.append("the placement plan changed (nodes, workers per node, CPUs or memory policy)")
    if old.admin.bind != new.admin.bind:
        out.append("admin.bind changed")
    if old.supervisor.runtime_dir != new.supervisor.runtime_dir:
        out.append("supervisor.runtime_dir changed")
    if old.ops != new.ops:
        changed = [k for k in ("readonly_group", "audit_log", "tcp_endpoint", "curve_secret_key",
                               "curve_authorized_keys")
                   if getattr(old.ops, k) != getattr(new.ops, k)]
        if changed:
            out.append("ops." + ", ops.".join(changed) + " changed")
    return out


class Reloader:
    """``reload`` (ops verb and SIGHUP): re-read, check, then roll every slot onto the new config.

    systemd: RELOADING=1 before the re-read (MONOTONIC_USEC = when it was asked,
    as Type=notify-reload checks), READY=1 when the roll ends or the reload is
    refused.  A refusal *because a reload is running* sends neither: that
    reload's READY=1 is what ends systemd's "reloading".
    """

    def __init__(self, table: SlotTable, plan: Plan, *, config_path: str | None,
                 overrides: dict[str, dict[str, Any]], operations: Operations, templates: TemplateManager,
                 notifier: Notifier, plane: OpsPlane, router: Router, spawner: Spawner,
                 status_line: Callable[[], str]) -> None:
        self.table = table
        self.plan = plan
        self.config_path = config_path
        self.overrides = overrides
        self.operations = operations
        self.templates = templates
        self.notifier = notifier
        self.plane = plane
        self.router = router
        self.spawner = spawner
        self.status_line = status_line
        self.signal_requests: set[asyncio.Task[Any]] = set()   # SIGHUP's ops requests in flight

    def on_hup(self, target: OpsTarget) -> None:
        """SIGHUP is a ``reload`` ops request (trigger "SIGHUP"): same path, same audit line as ``numaserve reload``."""
        from numaserve.supervisor.ops import handle_ops_request

        req = m.OpsRequest(verb="reload", args={"trigger": "SIGHUP"}, id=f"sighup-{uuid.uuid4().hex[:8]}")
        log.info("reload_requested", signal="SIGHUP", request=req.id)
        task = asyncio.get_running_loop().create_task(
            handle_ops_request(target, req, channel="signal", who={"signal": "SIGHUP"}), name="sighup")
        self.signal_requests.add(task)
        task.add_done_callback(self.signal_requests.discard)

    def start(self, args: dict[str, Any]) -> Operation:
        """The tracked ``reload`` operation, or NumaserveError (refused: nothing changed)."""
        busy = self.running()
        if not busy:
            self.notifier.reloading()
        try:
            return self._start(args)
        except NumaserveError as e:
            log.error("reload_refused", trigger=args.get("trigger", "ops"), reason=str(e))
            if not busy:
                self.notifier.reload_done(f"{self.status_line()} (reload refused: {e})")
            raise

    def running(self) -> bool:
        cur = self.operations.current
        return cur is not None and cur.kind == "reload" and cur.state == "running"

    def _start(self, args: dict[str, Any]) -> Operation:
        timeout_arg = arg_timeout(args, "timeout", None)
        # a revoked key must stop working even when the rest of the reload is refused
        self.plane.reload_curve_keys()
        new_cfg, topo, _ = load_for_reload(self.config_path, self.overrides, self.table.cfg, self.plan)
        timeout = new_cfg.server.graceful_timeout if timeout_arg is None else timeout_arg
        slots = list(self.table.slots.values())

        async def body(op: Operation) -> str:
            why = await self.templates.reload(new_cfg, op)  # make-before-break: old templates kept on failure
            if why:
                self.notifier.reload_done(self.status_line())
                raise OperationFailed(f"new app code failed to load, nothing rolled: {why}")
            self._apply(new_cfg, topo)
            op.step("config re-read", config=self.config_path or "(defaults)")
            try:
                return await self.operations.roll(op, slots, timeout, new_cfg.ops.reload_parallel)
            finally:
                self.notifier.reload_done(self.status_line())

        return self.operations.start("reload", args, [s.plan.slot for s in slots], body)

    def _apply(self, cfg: Config, topology: Topology) -> None:
        """The new config is live: the slot table, spawns, the ops gate and steering follow it."""
        self.table.cfg = cfg
        self.spawner.topology = topology
        self.plane.reconfigure(cfg)
        self.router.reconfigure()
