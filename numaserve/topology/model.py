"""The machine as numaserve sees it: plain data, no I/O.

Discovery (``numaserve.topology.discover``) fills these from a sysfs/procfs
root; placement, IRQ steering, doctor and status only read them.  Every value
that could not be read is ``None`` and the reason is kept in
``Topology.unknowns`` so an operator can see *why* something is unknown.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

IrqKind = Literal["queue", "admin", "unknown"]


@dataclass(frozen=True)
class Unknown:
    """A value discovery could not read: ``what`` names it, ``reason`` says why."""

    what: str
    reason: str


@dataclass(frozen=True)
class HugePages:
    size_kb: int
    total: int | None
    free: int | None


@dataclass
class Node:
    """One NUMA node.

    ``cpus`` are the node's online CPUs; ``usable_cpus`` those this process may
    run on (affinity ∩ cgroup cpuset).  ``distances`` maps node id → distance,
    with columns already re-keyed from online-node order to node ids.
    ``memory_node`` is the node whose memory a worker placed here binds to:
    the node itself, unless a declared topology maps a pretend node onto a
    real one.
    """

    id: int
    cpus: tuple[int, ...]
    usable_cpus: tuple[int, ...]
    memory_total_bytes: int | None
    memory_free_bytes: int | None
    distances: dict[int, int] = field(default_factory=dict)
    hugepages: tuple[HugePages, ...] = ()
    has_memory: bool = True
    memory_node: int | None = None
    memory_allowed: bool = True

    @property
    def cpu_less(self) -> bool:
        return not self.cpus

    @property
    def bind_node(self) -> int:
        return self.id if self.memory_node is None else self.memory_node


@dataclass(frozen=True)
class Irq:
    """One interrupt vector of a device.

    ``kind``: "queue" for a per-queue vector (TxRx, rx, tx, input.N, comp),
    "admin" for config/async/misc vectors that must be left alone, "unknown"
    when the name does not tell.  ``affinity`` is ``smp_affinity_list``,
    ``effective_affinity`` is ``effective_affinity_list`` (None when absent).
    """

    irq: int
    name: str | None
    kind: IrqKind
    queue: int | None = None
    affinity: tuple[int, ...] | None = None
    effective_affinity: tuple[int, ...] | None = None


@dataclass
class Nic:
    """A physical network interface (virtual devices are never listed).

    ``numa_node`` is None when unknown (sysfs -1 with no narrower
    local_cpulist and no override); ``numa_node_source`` says where the value
    came from: "sysfs", "local_cpulist", "declared" or "unknown".
    """

    name: str
    driver: str | None
    pci: str | None
    numa_node: int | None
    numa_node_source: str
    local_cpus: tuple[int, ...]
    rx_queues: int
    tx_queues: int
    irqs: list[Irq] = field(default_factory=list)
    device_path: str | None = None


@dataclass
class Gpu:
    """A GPU or accelerator on PCI (class 0x03xx display, 0x12xx processing accel,
    0x0b40 co-processor).  ``numa_node_source`` as for ``Nic``."""

    pci: str
    vendor: str | None
    device: str | None
    pci_class: str | None
    driver: str | None
    numa_node: int | None
    numa_node_source: str = "unknown"


@dataclass
class SystemInfo:
    """Host facts that later checks (doctor, IRQ steering, listeners) depend on."""

    kernel: str | None = None
    irqbalance_running: bool | None = None
    irqbalance_pids: tuple[int, ...] = ()
    sysctls: dict[str, int | str | None] = field(default_factory=dict)
    thp: str | None = None
    cgroup_version: int | None = None
    thp_defrag: str | None = None
    thp_khugepaged_defrag: int | None = None


@dataclass
class CpuFacts:
    """Per-CPU facts placement explains itself with; empty when unread.

    ``offline``: present but not online.  ``isolated``: ``cpu/isolated`` ∪
    ``isolcpus=`` (no scheduler load balancing there); ``nohz_full``: the tick
    stops only when one task runs.  ``packages``: CPU → physical package
    (socket); ``l3``: CPU → the CPUs sharing its last-level (L3) cache.
    """

    offline: tuple[int, ...] = ()
    isolated: tuple[int, ...] = ()
    nohz_full: tuple[int, ...] = ()
    packages: dict[int, int] = field(default_factory=dict)
    l3: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class Topology:
    """Everything discovery found, rooted at ``root`` ("/" for this machine).

    ``allowed_cpus`` = online ∩ sched_getaffinity ∩ cgroup ``cpuset.cpus.effective``;
    ``allowed_mems`` = online nodes ∩ cgroup ``cpuset.mems.effective`` (∩
    ``Mems_allowed_list``).  ``declared`` is the path of a declared topology
    file when one replaced or corrected sysfs.
    """

    root: str
    nodes: list[Node]
    online_cpus: tuple[int, ...]
    allowed_cpus: tuple[int, ...]
    allowed_mems: tuple[int, ...]
    possible_nodes: tuple[int, ...] = ()
    smt_siblings: dict[int, tuple[int, ...]] = field(default_factory=dict)
    nics: list[Nic] = field(default_factory=list)
    gpus: list[Gpu] = field(default_factory=list)
    system: SystemInfo = field(default_factory=SystemInfo)
    unknowns: list[Unknown] = field(default_factory=list)
    declared: str | None = None
    cpu_facts: CpuFacts = field(default_factory=CpuFacts)

    def node(self, node_id: int) -> Node:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(n.id for n in self.nodes)

    def cpu_node(self) -> dict[int, int]:
        """CPU id → node id, for every CPU of every node."""
        return {c: n.id for n in self.nodes for c in n.cpus}

    def to_json(self) -> dict[str, Any]:
        """Stable JSON form (the ``numaserve topology --json`` contract)."""
        return {
            "root": self.root,
            "declared": self.declared,
            "online_cpus": list(self.online_cpus),
            "allowed_cpus": list(self.allowed_cpus),
            "allowed_mems": list(self.allowed_mems),
            "possible_nodes": list(self.possible_nodes),
            "nodes": [
                {
                    "id": n.id,
                    "cpus": list(n.cpus),
                    "usable_cpus": list(n.usable_cpus),
                    "cpu_less": n.cpu_less,
                    "memory_total_bytes": n.memory_total_bytes,
                    "memory_free_bytes": n.memory_free_bytes,
                    "has_memory": n.has_memory,
                    "memory_node": n.bind_node,
                    "memory_allowed": n.memory_allowed,
                    "distances": {str(k): v for k, v in n.distances.items()},
                    "hugepages": [asdict(h) for h in n.hugepages],
                    "nics": [x.name for x in self.nics if x.numa_node == n.id],
                    "gpus": [g.pci for g in self.gpus if g.numa_node == n.id],
                }
                for n in self.nodes
            ],
            "smt_siblings": {str(k): list(v) for k, v in sorted(self.smt_siblings.items())},
            "nics": [
                {
                    "name": x.name,
                    "driver": x.driver,
                    "pci": x.pci,
                    "numa_node": x.numa_node,
                    "numa_node_source": x.numa_node_source,
                    "local_cpus": list(x.local_cpus),
                    "rx_queues": x.rx_queues,
                    "tx_queues": x.tx_queues,
                    "irqs": [
                        {
                            "irq": i.irq,
                            "name": i.name,
                            "kind": i.kind,
                            "queue": i.queue,
                            "affinity": None if i.affinity is None else list(i.affinity),
                            "effective_affinity": None
                            if i.effective_affinity is None
                            else list(i.effective_affinity),
                        }
                        for i in x.irqs
                    ],
                }
                for x in self.nics
            ],
            "gpus": [asdict(g) for g in self.gpus],
            "system": {
                "kernel": self.system.kernel,
                "irqbalance_running": self.system.irqbalance_running,
                "irqbalance_pids": list(self.system.irqbalance_pids),
                "sysctls": dict(self.system.sysctls),
                "thp": self.system.thp,
                "cgroup_version": self.system.cgroup_version,
            },
            "unknowns": [asdict(u) for u in self.unknowns],
        }
