"""Which NUMA node a PCI device (NIC, GPU) is attached to.

``numa_node`` is -1 on many real machines (firmware without locality, VMs:
FACTS §4).  Then ``local_cpulist`` can still tell, when it is narrower than
all online CPUs and falls inside exactly one node.  Otherwise the node is
unknown: IRQ steering must not guess (Intel's script silently uses node 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from numaserve.cpulist import format_list
from numaserve.topology.model import Node

__all__ = ["Location", "locate", "identity_map"]


@dataclass(frozen=True)
class Location:
    node: int | None
    source: str  # "sysfs", "local_cpulist", "declared" or "unknown"
    reason: str | None = None  # why it is unknown


def identity_map(nodes: Sequence[Node]) -> Callable[[int], int | None]:
    """Map a sysfs node id to itself when it is one of ``nodes``."""
    ids = {n.id for n in nodes}
    return lambda nid: nid if nid in ids else None


def locate(
    numa_node: int | None,
    local_cpus: tuple[int, ...] | None,
    online_cpus: tuple[int, ...],
    nodes: Sequence[Node],
    sysfs_to_node: Callable[[int], int | None] | None = None,
) -> Location:
    """Node from sysfs ``numa_node`` (≥ 0, mapped through ``sysfs_to_node``), else from
    a narrow ``local_cpulist``, else unknown with the reason."""
    to_node = sysfs_to_node or identity_map(nodes)
    reasons: list[str] = []
    if numa_node is None:
        reasons.append("numa_node missing")
    elif numa_node < 0:
        reasons.append(f"numa_node = {numa_node}")
    else:
        mapped = to_node(numa_node)
        if mapped is not None:
            return Location(mapped, "sysfs")
        reasons.append(f"numa_node = {numa_node} is not one node of this topology")
    if local_cpus is None:
        reasons.append("no local_cpulist")
        return Location(None, "unknown", ", ".join(reasons))
    online = set(online_cpus)
    local = set(local_cpus) & online if online else set(local_cpus)
    if not local:
        reasons.append("local_cpulist has no online CPU")
    elif online and local >= online:
        reasons.append(f"local_cpulist {format_list(local)} is every online CPU")
    else:
        homes = [n.id for n in nodes if n.cpus and local <= set(n.cpus)]
        if len(homes) == 1:
            return Location(homes[0], "local_cpulist")
        reasons.append(f"local_cpulist {format_list(local)} is not inside exactly one node")
    return Location(None, "unknown", ", ".join(reasons))
