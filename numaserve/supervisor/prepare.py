"""From a loaded config to what the supervisor runs: the topology and the placement plan.

One function for both ``numaserve start`` and a reload, so a config that
starts is exactly a config that reloads (the same checks, in the same order);
every refusal is a ``NumaserveError`` naming the key, raised before anything
is changed.
"""

from __future__ import annotations

from numaserve.bind.allocator import check_allocator
from numaserve.config import Config
from numaserve.bind.placement import Plan, make_plan
from numaserve.supervisor.spawn import check_cmd_template
from numaserve.topology import discover
from numaserve.topology.model import Topology
from numaserve.worker.tls import check_tls

__all__ = ["prepare"]


def prepare(cfg: Config) -> tuple[Topology, Plan]:
    """Check what a worker would need (cmd template, TLS files, allocator), then discover and plan."""
    if cfg.server.cmd:
        check_cmd_template(cfg.server.cmd, allow_host_port=cfg.cmd.allow_host_port)
    check_tls(cfg.tls)
    check_allocator(cfg.allocator)
    topo = discover(cfg.placement.sysfs_root, declared=cfg.placement.topology_file or None)
    return topo, make_plan(topo, cfg.placement)
