"""Human-readable ``numaserve topology`` output: rich tables, one per concern.

Only for a terminal; scripts get ``Topology.to_json()``.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from numaserve.cpulist import format_list
from numaserve.topology.model import Topology

__all__ = ["render", "human_bytes"]


def human_bytes(n: int | None) -> str:
    """1536 MiB → "1.5 GiB"; "?" when unknown."""
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _row(table: Table, *cells: str) -> None:
    # plain Text: values like "[nic]" or "always [madvise]" are data, not rich markup
    table.add_row(*(Text(c) for c in cells))


def _cpus(cpus: tuple[int, ...]) -> str:
    return format_list(cpus) or "-"


def _node(nid: int | None, source: str) -> str:
    return "? (unknown)" if nid is None else f"{nid} ({source})"


def _nodes_table(topo: Topology) -> Table:
    t = Table(title="NUMA nodes", title_justify="left")
    for col in ("node", "cpus", "usable", "memory", "free", "mem node", "hugepages", "nics", "gpus"):
        t.add_column(col, justify="right" if col in ("node", "memory", "free") else "left",
                     no_wrap=col in ("node", "memory", "free", "mem node"))
    for n in topo.nodes:
        hp = ", ".join(f"{h.total if h.total is not None else '?'}x{h.size_kb}kB" for h in n.hugepages if h.total)
        mem_node = str(n.bind_node) + ("" if n.memory_allowed else " (not allowed)")
        if not n.has_memory:
            mem_node += " (no memory)"
        _row(
            t,
            str(n.id),
            _cpus(n.cpus) if n.cpus else "- (cpu-less)",
            _cpus(n.usable_cpus),
            human_bytes(n.memory_total_bytes),
            human_bytes(n.memory_free_bytes),
            mem_node,
            hp or "-",
            ", ".join(x.name for x in topo.nics if x.numa_node == n.id) or "-",
            str(sum(1 for g in topo.gpus if g.numa_node == n.id) or "-"),
        )
    return t


def _distance_table(topo: Topology) -> Table:
    t = Table(title="Distances", title_justify="left")
    t.add_column("from \\ to", justify="right")
    for n in topo.nodes:
        t.add_column(str(n.id), justify="right")
    for n in topo.nodes:
        _row(t, str(n.id), *(str(n.distances.get(m.id, "?")) for m in topo.nodes))
    return t


def _nics_table(topo: Topology) -> Table:
    t = Table(title="NICs", title_justify="left")
    for col in ("name", "driver", "pci", "node", "local cpus", "rx/tx", "irqs (q/a/?)"):
        t.add_column(col, no_wrap=col in ("name", "pci"))
    for x in topo.nics:
        kinds = {k: sum(1 for i in x.irqs if i.kind == k) for k in ("queue", "admin", "unknown")}
        _row(
            t,
            x.name,
            x.driver or "?",
            x.pci or "-",
            _node(x.numa_node, x.numa_node_source),
            _cpus(x.local_cpus),
            f"{x.rx_queues}/{x.tx_queues}",
            f"{len(x.irqs)} ({kinds['queue']}/{kinds['admin']}/{kinds['unknown']})",
        )
    return t


def _gpus_table(topo: Topology) -> Table:
    t = Table(title="GPUs and accelerators", title_justify="left")
    for col in ("pci", "class", "vendor:device", "driver", "node"):
        t.add_column(col, no_wrap=col == "pci")
    for g in topo.gpus:
        _row(t, g.pci, g.pci_class or "?", f"{g.vendor or '?'}:{g.device or '?'}", g.driver or "-",
                  _node(g.numa_node, g.numa_node_source))
    return t


def _system_table(topo: Topology) -> Table:
    s = topo.system
    t = Table(title="System", title_justify="left", show_header=False)
    t.add_column("fact")
    t.add_column("value")

    def val(v: object) -> str:
        return "?" if v is None else str(v)

    _row(t, "kernel", val(s.kernel))
    irqb = "?" if s.irqbalance_running is None else (
        f"running (pid {format_list(s.irqbalance_pids)})" if s.irqbalance_running else "not running")
    _row(t, "irqbalance", irqb)
    for k, v in s.sysctls.items():
        _row(t, k, val(v))
    _row(t, "transparent hugepages", val(s.thp))
    _row(t, "cgroup version", val(s.cgroup_version))
    _row(t, "online cpus", _cpus(topo.online_cpus))
    _row(t, "allowed cpus", _cpus(topo.allowed_cpus))
    _row(t, "allowed memory nodes", _cpus(topo.allowed_mems))
    _row(t, "possible nodes", _cpus(topo.possible_nodes))
    return t


def render(topo: Topology, console: Console | None = None) -> None:
    """Print the topology as tables (nodes, distances, NICs, GPUs, system, unknowns)."""
    console = console or Console()
    head = f"root {topo.root}"
    if topo.declared:
        head += f", declared topology {topo.declared}"
    console.print(Text(head))
    console.print(_nodes_table(topo))
    console.print(_distance_table(topo))
    console.print(_nics_table(topo) if topo.nics else Text("NICs: none found"))
    if topo.gpus:
        console.print(_gpus_table(topo))
    console.print(_system_table(topo))
    if topo.unknowns:
        t = Table(title="Unknown", title_justify="left")
        t.add_column("what")
        t.add_column("why")
        for u in topo.unknowns:
            _row(t, u.what, u.reason)
        console.print(t)
