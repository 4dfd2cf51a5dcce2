"""Reload: re-read the config under the same flags and decide whether it can apply in place.

Listeners and the placement plan are fixed for the supervisor's life (they
define the reuseport groups and the bindings); anything else rolls onto the
slots through a tracked ``reload`` operation (make before break).  A config
that cannot apply is refused with every reason, and nothing changes.
"""

from __future__ import annotations

from typing import Any

from numaserve.config import Config, load_config
from numaserve.errors import NumaserveError
from numaserve.bind.placement import Plan
from numaserve.supervisor.cmdready import host_port_placeholders
from numaserve.supervisor.prepare import prepare
from numaserve.topology.model import Topology

__all__ = ["load_for_reload", "reload_blockers"]


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
    if old.admin != new.admin:
        changed = [k for k in ("enabled", "bind", "max_connections", "idle_timeout")
                   if getattr(old.admin, k) != getattr(new.admin, k)]
        out.append("admin." + ", admin.".join(changed) + " changed")
    if old.supervisor.runtime_dir != new.supervisor.runtime_dir:
        out.append("supervisor.runtime_dir changed")
    if old.ops != new.ops:
        changed = [k for k in ("readonly_group", "audit_log", "tcp_endpoint", "curve_secret_key",
                               "curve_authorized_keys", "max_connections")
                   if getattr(old.ops, k) != getattr(new.ops, k)]
        if changed:
            out.append("ops." + ", ops.".join(changed) + " changed")
    return out
