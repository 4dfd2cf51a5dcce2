"""Machine discovery: sysfs/procfs under a root path → ``Topology`` (plain data).

``discover("/")`` reads this machine; ``discover(dump_dir)`` reads a dump
(hwloc-gather-topology tarball, hand-made test tree) the same way.  Nothing
here raises for a missing, empty or odd file: the value becomes ``None`` (or
empty) and ``Topology.unknowns`` says why.  Only an unusable root or a bad
declared topology file raise (``UsageError``).

One module per job: ``sysfs`` (reads inside the root), ``cpus``, ``nodes``,
``allowed`` (affinity + cgroup cpuset), ``nics`` + ``interrupts`` +
``locality``, ``gpus``, ``system``, ``declared``, ``render``.
"""

from __future__ import annotations

import os
from typing import Mapping

from numaserve.cpulist import format_list
from numaserve.errors import UsageError
from numaserve.topology.allowed import read_affinity, read_cgroup, read_status_mems
from numaserve.topology.cpufacts import read_cpu_facts
from numaserve.topology.cpus import online_cpus, smt_siblings
from numaserve.topology.declared import apply_declared, declared_sysfs_map, load_declared
from numaserve.topology.gpus import discover_gpus
from numaserve.topology.interrupts import parse_interrupts
from numaserve.topology.locality import identity_map
from numaserve.topology.model import CpuFacts, Gpu, HugePages, Irq, Nic, Node, SystemInfo, Topology, Unknown
from numaserve.topology.nics import discover_nics
from numaserve.topology.nodes import discover_nodes
from numaserve.topology.sysfs import Root, Unknowns
from numaserve.topology.system import discover_system

__all__ = [
    "discover", "Topology", "CpuFacts", "Node", "Nic", "Irq", "Gpu", "HugePages", "SystemInfo", "Unknown",
]


def _intersect(base: tuple[int, ...], *bounds: tuple[int, ...] | None) -> tuple[int, ...]:
    out = set(base)
    for b in bounds:
        if b is not None:
            out &= set(b)
    return tuple(sorted(out))


def _check_root(fs: Root, root: str) -> None:
    if not os.path.isdir(fs.base):
        raise UsageError(f"sysfs root {root}: no such directory")
    if not fs.is_dir("sys/devices/system"):
        raise UsageError(f"sysfs root {root}: no sys/devices/system under it (not a sysfs/procfs root or dump)")


def discover(
    root: str = "/", *, declared: str | None = None, nic_nodes: Mapping[str, int] | None = None
) -> Topology:
    """Read the machine under ``root``.

    ``declared``: a declared topology file (see ``numaserve.topology.declared``)
    that replaces or corrects the sysfs nodes.  ``nic_nodes``: interface →
    node overrides; they win over the declared file's ``[nic]`` table and
    over sysfs.
    """
    fs = Root(root)
    _check_root(fs, root)
    decl = load_declared(declared) if declared else None
    unknowns = Unknowns()

    online = online_cpus(fs, unknowns)
    scan = discover_nodes(fs, online, unknowns)
    if online is None:
        online = tuple(sorted({c for n in scan.nodes for c in n.cpus}))
    smt = smt_siblings(fs, online, unknowns)
    cpu_facts = read_cpu_facts(fs, online, unknowns)

    cgroup = read_cgroup(fs, unknowns)
    allowed_cpus = _intersect(online, read_affinity(fs, unknowns), cgroup.cpus)
    node_ids = tuple(n.id for n in scan.nodes)
    allowed_mems = _intersect(node_ids, cgroup.mems, read_status_mems(fs, unknowns))
    if online and not allowed_cpus:
        unknowns.add("allowed cpus", "affinity ∩ cgroup cpuset leaves no online CPU")
    if not allowed_mems:
        unknowns.add("allowed memory nodes", "cgroup cpuset ∩ Mems_allowed leaves no node")

    nodes = scan.nodes
    for n in nodes:
        n.usable_cpus = _intersect(n.cpus, allowed_cpus)
        n.memory_allowed = n.id in allowed_mems

    overrides: dict[str, int] = {}
    sysfs_to_node = identity_map(nodes)
    if decl is not None:
        nodes = apply_declared(decl, nodes, online, allowed_cpus, allowed_mems)
        overrides.update(decl.nics)
        sysfs_to_node = declared_sysfs_map(decl, nodes)
    ids = {n.id for n in nodes}
    for name, nid in (nic_nodes or {}).items():
        if nid not in ids:
            raise UsageError(f"nic {name}: node = {nid!r}: no such node (nodes: {format_list(ids)})")
        overrides[name] = nid

    interrupts = fs.read("proc/interrupts")
    if interrupts is None:
        unknowns.add("irq names", "proc/interrupts: missing; IRQ names from proc/irq/N/ only")
    irq_names = parse_interrupts(interrupts) if interrupts is not None else None
    nics = discover_nics(fs, nodes, online, irq_names, unknowns, overrides=overrides, sysfs_to_node=sysfs_to_node)
    found = {x.name for x in nics}
    for name in overrides:
        if name not in found:
            unknowns.add(f"nic {name}", "a node override names it, but it is not a physical NIC here")
    gpus = discover_gpus(fs, nodes, online, unknowns, sysfs_to_node=sysfs_to_node)

    return Topology(
        root=fs.base,
        nodes=nodes,
        online_cpus=online,
        allowed_cpus=allowed_cpus,
        allowed_mems=allowed_mems,
        possible_nodes=scan.possible,
        smt_siblings=smt,
        nics=nics,
        gpus=gpus,
        system=discover_system(fs, unknowns, cgroup.version),
        unknowns=list(unknowns.items),
        declared=declared,
        cpu_facts=cpu_facts,
    )
