"""NUMA nodes from ``sys/devices/system/node``: CPUs, memory, distances, hugepages.

Rules forced by real machines (FACTS §3.2): node ids are sparse and sorted
numerically; ``distance`` columns follow ascending *online* node order and
are re-keyed to node ids here; ``cpulist`` may be missing (``cpumap`` then);
memory-only nodes have an empty cpulist.  A kernel without NUMA has no node
directories at all: one node 0 is synthesized from the online CPUs and
``/proc/meminfo``, and that is recorded as an ``Unknown``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from numaserve.topology.model import HugePages, Node
from numaserve.topology.sysfs import Root, Unknowns, read_cpus, read_int, read_list

__all__ = ["NODE_DIR", "NodeScan", "discover_nodes", "parse_meminfo", "hugepages_in"]

NODE_DIR = "sys/devices/system/node"
_NODE_RE = re.compile(r"^node(\d+)$")
_HP_RE = re.compile(r"^hugepages-(\d+)kB$")
_MEMINFO_RE = re.compile(r"^(?:Node\s+\d+\s+)?([A-Za-z_()0-9]+):\s+(\d+)(\s*kB)?\s*$")


@dataclass
class NodeScan:
    """What the node directory says: the nodes, ``possible`` and whether NUMA is real."""

    nodes: list[Node]
    possible: tuple[int, ...]
    synthesized: bool = False


def parse_meminfo(text: str) -> dict[str, int]:
    """``meminfo`` (node or /proc) → field → value, "kB" fields converted to bytes."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = _MEMINFO_RE.match(line.strip())
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    return out


def hugepages_in(fs: Root, rel_dir: str) -> tuple[HugePages, ...]:
    """Hugepage pools under ``rel_dir`` (``hugepages-<size>kB/{nr,free}_hugepages``), by size."""
    pools = []
    for entry in fs.listdir(rel_dir):
        m = _HP_RE.match(entry)
        if m:
            pools.append(
                HugePages(
                    size_kb=int(m.group(1)),
                    total=read_int(fs, f"{rel_dir}/{entry}/nr_hugepages"),
                    free=read_int(fs, f"{rel_dir}/{entry}/free_hugepages"),
                )
            )
    return tuple(sorted(pools, key=lambda h: h.size_kb))


def _memory(fs: Root, rel: str, what: str, unknowns: Unknowns) -> tuple[int | None, int | None]:
    text = fs.read(rel)
    if text is None:
        unknowns.add(what, f"{rel}: missing")
        return None, None
    info = parse_meminfo(text)
    total, free = info.get("MemTotal"), info.get("MemFree")
    if total is None or free is None:
        unknowns.add(what, f"{rel}: no MemTotal/MemFree line")
    return total, free


def _distances(
    fs: Root, node_id: int, column_order: list[tuple[int, ...]], unknowns: Unknowns
) -> dict[int, int]:
    rel = f"{NODE_DIR}/node{node_id}/distance"
    text = fs.read(rel)
    what = f"node {node_id} distances"
    if text is None:
        unknowns.add(what, f"{rel}: missing")
        return {}
    try:
        row = [int(x) for x in text.split()]
    except ValueError:
        unknowns.add(what, f"{rel}: not a list of integers: {text.strip()[:60]!r}")
        return {}
    for order in column_order:
        if len(order) == len(row):
            return dict(zip(order, row))
    unknowns.add(what, f"{rel}: {len(row)} columns but {len(column_order[0])} online nodes")
    return {}


def discover_nodes(fs: Root, online_cpus: tuple[int, ...] | None, unknowns: Unknowns) -> NodeScan:
    """Every ``node<N>`` directory, sorted by id; one synthesized node 0 when there are none."""
    ids = sorted(int(m.group(1)) for e in fs.listdir(NODE_DIR) if (m := _NODE_RE.match(e)))
    if not ids:
        return _synthesize(fs, online_cpus, unknowns)
    online_set = set(online_cpus) if online_cpus is not None else None
    online_nodes = read_list(fs, f"{NODE_DIR}/online")
    # an empty has_cpu/has_memory contradicts any real machine (seen in edited dumps): ignore it
    has_cpu = read_list(fs, f"{NODE_DIR}/has_cpu") or None
    has_memory = read_list(fs, f"{NODE_DIR}/has_memory") or None
    possible = read_list(fs, f"{NODE_DIR}/possible")
    if possible is None:
        unknowns.add("possible nodes", f"{NODE_DIR}/possible: missing or garbage; using the node directories")
        possible = tuple(ids)
    # distance columns: ascending online nodes; the node dirs when "online" does not fit
    column_order = [tuple(online_nodes)] if online_nodes else []
    column_order.append(tuple(ids))

    nodes: list[Node] = []
    for nid in ids:
        base = f"{NODE_DIR}/node{nid}"
        cpus = read_cpus(fs, f"{base}/cpulist", f"{base}/cpumap", f"node {nid} cpus", None)
        if cpus is None:
            if has_cpu is not None and nid not in has_cpu:
                cpus = ()
            else:
                unknowns.add(f"node {nid} cpus", f"{base}/cpulist and {base}/cpumap: missing or garbage")
                cpus = ()
        if online_set is not None:
            cpus = tuple(c for c in cpus if c in online_set)
        total, free = _memory(fs, f"{base}/meminfo", f"node {nid} memory", unknowns)
        if has_memory is not None:
            has_mem = nid in has_memory
        else:
            has_mem = total != 0
        nodes.append(
            Node(
                id=nid,
                cpus=cpus,
                usable_cpus=cpus,
                memory_total_bytes=total,
                memory_free_bytes=free,
                distances=_distances(fs, nid, column_order, unknowns),
                hugepages=hugepages_in(fs, f"{base}/hugepages"),
                has_memory=has_mem,
            )
        )
    return NodeScan(nodes=nodes, possible=possible)


def _synthesize(fs: Root, online_cpus: tuple[int, ...] | None, unknowns: Unknowns) -> NodeScan:
    unknowns.add(
        "numa nodes",
        f"no {NODE_DIR}/node<N> directories (kernel without NUMA?): assuming one node 0 "
        "with every online CPU and all memory",
    )
    total, free = _memory(fs, "proc/meminfo", "node 0 memory", unknowns)
    node = Node(
        id=0,
        cpus=tuple(online_cpus or ()),
        usable_cpus=tuple(online_cpus or ()),
        memory_total_bytes=total,
        memory_free_bytes=free,
        distances={0: 10},
        hugepages=hugepages_in(fs, "sys/kernel/mm/hugepages"),
        has_memory=total != 0,
    )
    return NodeScan(nodes=[node], possible=(0,), synthesized=True)
