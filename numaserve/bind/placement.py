"""Topology + Config → Plan: which worker slots exist and how each is bound.

Pure: takes data, returns data.  ``make_plan`` raises ``UsageError`` (exit 2)
for a request that cannot be satisfied on this machine (a node that does not
exist or this process may not use), naming the usable nodes.

Rules, in the order ``make_plan`` applies them:

* **Nodes.** ``"all"`` takes every node that can host a worker and lists the
  others in ``Plan.skipped`` with the reason (memory-only node, no CPU this
  process may use, memory node forbidden by the cgroup).  An explicit list
  (``"0,2-3"``) must name only such nodes: anything else is an error, because
  silently dropping a node the operator asked for hides a misconfiguration.
* **IRQ cores.** ``reserve_irq_cpus = K`` keeps the last K physical cores of a
  node with a local NIC away from its workers (they take the NIC's
  interrupts; IRQ steering uses the same set via ``reserved_irq_cpus``).
  At least one core is always left to the workers.
* **Workers per node.** An integer, or ``"auto"``: the node's GPU count when
  it has GPUs, else its physical cores among the CPUs left to workers.
* **CPUs.** ``split``: contiguous chunks of whole cores in CPU order; falls
  back to hardware threads, then to sharing, when there are more workers than
  cores or CPUs (noted).  ``shared``: every worker gets all the CPUs.
* **Memory.** ``bind`` (default) and ``preferred`` name the node's real
  memory node (``Node.bind_node``); ``interleave`` names the memory nodes of
  every planned node; ``local`` names none.
* **GPUs.** Round-robin over the workers when there are at least as many GPUs
  as workers, else every worker of the node sees all its GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Sequence

from numaserve.config import PlacementConfig
from numaserve.cpulist import format_list
from numaserve.errors import UsageError
from numaserve.cpulist import parse_node_spec
from numaserve.bind.shapes import check_shape, l3_slots
from numaserve.workerenv import GPU_VENDORS
from numaserve.topology.gpus import is_compute_gpu
from numaserve.topology.model import Node, Topology

__all__ = [
    "SlotPlan",
    "SkippedNode",
    "Plan",
    "make_plan",
    "reserved_irq_cpus",
    "physical_cores",
    "placeable_cpus",
    "split_cpus",
    "parse_workers_per_node",
    "format_nodes",
]

MEMPOLICIES = ("bind", "preferred", "interleave", "local")
CPU_SPLITS = ("split", "shared")
SplitMode = Literal["cores", "threads", "shared"]


@dataclass(frozen=True)
class SlotPlan:
    """One worker slot.

    ``slot`` is the global index and also the listener slot (one SO_REUSEPORT
    socket per slot); ``index`` is the worker's index within its node.
    ``mempolicy`` is one of bind|preferred|interleave|local; ``memory_nodes``
    the nodes it names (the node's real memory node; all usable nodes for
    interleave; empty for local).
    """

    slot: int
    node: int
    index: int
    cpus: tuple[int, ...]
    mempolicy: str
    memory_nodes: tuple[int, ...]
    gpus: tuple[str, ...] = ()
    listener: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "slot": self.slot,
            "node": self.node,
            "index": self.index,
            "cpus": list(self.cpus),
            "mempolicy": self.mempolicy,
            "memory_nodes": list(self.memory_nodes),
            "gpus": list(self.gpus),
            "listener": self.listener,
        }


@dataclass(frozen=True)
class SkippedNode:
    node: int
    reason: str


@dataclass
class Plan:
    """The placement: slots, the nodes left out and why, and notes for the operator.

    ``irq_cpus`` maps node id → CPUs kept away from workers for NIC IRQs
    (only nodes where something was reserved).
    """

    slots: list[SlotPlan]
    skipped: list[SkippedNode] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    mempolicy: str = "bind"
    workers_per_node: int | str = 1
    cpu_split: str = "split"
    irq_cpus: dict[int, tuple[int, ...]] = field(default_factory=dict)
    shape: str = "node"

    @property
    def nodes(self) -> tuple[int, ...]:
        """The planned nodes, in slot order."""
        return tuple(dict.fromkeys(s.node for s in self.slots))

    def to_json(self) -> dict[str, Any]:
        return {
            "slots": [s.to_json() for s in self.slots],
            "skipped": [{"node": s.node, "reason": s.reason} for s in self.skipped],
            "notes": list(self.notes),
            "mempolicy": self.mempolicy,
            "workers_per_node": self.workers_per_node,
            "cpu_split": self.cpu_split,
            "irq_cpus": {str(k): list(v) for k, v in sorted(self.irq_cpus.items())},
            "shape": self.shape,
        }


# --- CPU helpers (pure) ---------------------------------------------------------


def physical_cores(topo: Topology, cpus: Iterable[int]) -> list[tuple[int, ...]]:
    """Group ``cpus`` into physical cores (SMT siblings together), ordered by first CPU.

    Siblings come from ``topo.smt_siblings``; a CPU without an entry is its own
    core.  Only CPUs in ``cpus`` appear in the result, so a core half-forbidden
    by a cpuset counts with the thread that is left.
    """
    wanted = set(cpus)
    seen: set[int] = set()
    cores: list[tuple[int, ...]] = []
    for c in sorted(wanted):
        if c in seen:
            continue
        core = tuple(sorted(({c} | set(topo.smt_siblings.get(c, ()))) & wanted - seen))
        seen.update(core)
        cores.append(core)
    return cores


def _chunks(items: Sequence[Any], n: int) -> list[list[Any]]:
    """Split into n contiguous chunks; the first len % n chunks get one extra item."""
    base, extra = divmod(len(items), n)
    out: list[list[Any]] = []
    start = 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        out.append(list(items[start:start + size]))
        start += size
    return out


def split_cpus(
    topo: Topology, cpus: Sequence[int], n: int
) -> tuple[list[tuple[int, ...]], SplitMode]:
    """Divide ``cpus`` among ``n`` workers; returns the per-worker CPUs and how.

    "cores": whole cores (SMT siblings stay together), contiguous in CPU
    order, the remainder going one extra core to the first workers — so no
    two workers share a core's caches and execution units.  "threads": more
    workers than cores, so cores are split by hardware thread (siblings still
    adjacent).  "shared": more workers than CPUs; CPUs are dealt round-robin
    and some workers share one.
    """
    if n < 1:
        raise ValueError(f"cannot split CPUs among {n} workers")
    cores = physical_cores(topo, cpus)
    if n <= len(cores):
        return [tuple(sorted(c for core in chunk for c in core)) for chunk in _chunks(cores, n)], "cores"
    threads = [c for core in cores for c in core]
    if n <= len(threads):
        return [tuple(sorted(chunk)) for chunk in _chunks(threads, n)], "threads"
    return [(threads[i % len(threads)],) for i in range(n)], "shared"


def _local_nic(topo: Topology, node_id: int) -> bool:
    return any(nic.numa_node == node_id for nic in topo.nics)


def _reserve(topo: Topology, node: Node, k: int) -> tuple[tuple[int, ...], str | None]:
    """(reserved CPUs, note) for one node; see ``reserved_irq_cpus``."""
    if k < 0:
        raise ValueError(f"reserve_irq_cpus must be >= 0, got {k}")
    if k == 0 or not _local_nic(topo, node.id):
        return (), None
    cores = physical_cores(topo, placeable_cpus(topo, node))
    if len(cores) <= 1:
        return (), (
            f"node {node.id}: reserve_irq_cpus = {k} not applied: the node has "
            f"{len(cores)} usable core(s) and workers need at least one"
        )
    take = min(k, len(cores) - 1)
    reserved = tuple(sorted(c for core in cores[-take:] for c in core))
    note = None
    if take < k:
        note = (
            f"node {node.id}: reserve_irq_cpus = {k} would take all {len(cores)} usable cores; "
            f"reserved {take} ({format_list(reserved)}) and left 1 core to workers"
        )
    return reserved, note


def reserved_irq_cpus(topo: Topology, node_id: int, k: int) -> tuple[int, ...]:
    """CPUs of ``node_id`` kept for NIC interrupts when ``reserve_irq_cpus = k``.

    The last ``k`` physical cores (with all their SMT siblings) of the node's
    usable CPUs, when the node has a local NIC; empty otherwise.  Never the
    whole node: at most all cores but one.  Placement keeps workers off these
    CPUs and IRQ steering puts the NIC's queue interrupts on them, so both use
    this one function.  KeyError for a node not in ``topo``.
    """
    return _reserve(topo, topo.node(node_id), k)[0]


def format_nodes(ids: Iterable[int]) -> str:
    """Node ids for people: "0,1", "0-3,8", "none" (ranges only for runs of three or more,
    since node lists are short and "0-1" reads like a typo)."""
    vals = sorted(set(ids))
    parts: list[str] = []
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{vals[i]}-{vals[j]}")
        else:
            parts.extend(str(v) for v in vals[i:j + 1])
        i = j + 1
    return ",".join(parts) or "none"


# --- argument parsing -----------------------------------------------------------


def parse_workers_per_node(value: int | str) -> int | Literal["auto"]:
    """An integer >= 1 (also as text) or "auto"; UsageError otherwise."""
    expected = 'expected an integer >= 1 or "auto"'
    if isinstance(value, bool):
        raise UsageError(f"workers per node {value!r}: {expected}")
    if isinstance(value, int):
        if value < 1:
            raise UsageError(f"workers per node {value}: {expected}")
        return value
    if isinstance(value, str):
        s = value.strip().lower()
        if s == "auto":
            return "auto"
        if s.isdigit() and int(s) >= 1:
            return int(s)
    raise UsageError(f"workers per node {value!r}: {expected}")


def _requested_nodes(nodes: str | Iterable[int]) -> tuple[int, ...] | None:
    if isinstance(nodes, str):
        try:
            return parse_node_spec(nodes)
        except ValueError as e:
            raise UsageError(f'node spec {nodes!r}: expected "all" or a node list like 0,2-3 ({e})') from None
    return tuple(sorted(set(int(n) for n in nodes)))


# --- node eligibility ------------------------------------------------------------


def _memory_problem(topo: Topology, node: Node, mempolicy: str) -> str | None:
    """Why a bind/preferred policy for ``node`` would fail with EINVAL, or None."""
    if mempolicy not in ("bind", "preferred"):
        return None  # interleave picks among allowed nodes; local names none
    mem = node.bind_node
    if topo.allowed_mems and mem not in topo.allowed_mems:
        return (
            f"its memory node {mem} is not allowed by the cgroup cpuset "
            f"(allowed memory nodes: {format_nodes(topo.allowed_mems)})"
        )
    target = next((n for n in topo.nodes if n.id == mem), None)
    if target is not None and not target.has_memory:
        return f'its memory node {mem} has no memory (use mempolicy = "local" or "interleave")'
    return None


def placeable_cpus(topo: Topology, node: Node) -> tuple[int, ...]:
    """The node's CPUs a worker may get: usable (affinity ∩ cpuset) and not isolated.

    Isolated CPUs (``isolcpus``) are left out: the scheduler never balances
    load onto them, so a worker's threads would pile up on one CPU, and they
    were isolated for some other latency-critical task.
    """
    isolated = set(topo.cpu_facts.isolated)
    return tuple(c for c in node.usable_cpus if c not in isolated)


def _skip_reason(topo: Topology, node: Node, mempolicy: str) -> str | None:
    """Why ``node`` cannot host workers, or None when it can."""
    if node.cpu_less:
        return "no CPUs (memory-only node)"
    if not node.usable_cpus:
        return (
            f"no usable CPUs: this process may not run on its CPUs {format_list(node.cpus)} "
            f"(allowed CPUs: {format_list(topo.allowed_cpus) or 'none'}; affinity or cgroup cpuset)"
        )
    if not placeable_cpus(topo, node):
        return f"its usable CPUs {format_list(node.usable_cpus)} are all isolated (isolcpus)"
    return _memory_problem(topo, node, mempolicy)


def _interleave_nodes(topo: Topology, planned: Sequence[Node]) -> tuple[int, ...]:
    by_id = {n.id: n for n in topo.nodes}
    out = set()
    for n in planned:
        mem = n.bind_node
        if topo.allowed_mems and mem not in topo.allowed_mems:
            continue
        if mem in by_id and not by_id[mem].has_memory:
            continue
        out.add(mem)
    return tuple(sorted(out))


def _deal_gpus(node: Node, node_gpus: tuple[str, ...], n: int, notes: list[str]) -> list[tuple[str, ...]]:
    """GPUs of each of ``n`` workers of a node: round-robin when there are at least
    as many GPUs as workers, else every worker sees all of them (noted)."""
    if n > 1 and len(node_gpus) >= n:
        return [tuple(node_gpus[i::n]) for i in range(n)]
    if n > 1 and node_gpus:
        notes.append(f"node {node.id}: {n} workers share its {len(node_gpus)} GPU(s)")
    return [node_gpus] * n


def _split(topo: Topology, node: Node, worker_cpus: tuple[int, ...], n: int, cpu_split: str,
           notes: list[str]) -> list[tuple[int, ...]]:
    """``worker_cpus`` for ``n`` workers of a node (``cpu_split``), noting any sharing."""
    if cpu_split == "shared":
        return [worker_cpus] * n
    per_cpus, mode = split_cpus(topo, worker_cpus, n)
    if mode == "threads":
        ncores = len(physical_cores(topo, worker_cpus))
        notes.append(
            f"node {node.id}: {n} workers > {ncores} physical cores: "
            "split by hardware thread, so some workers share a core"
        )
    elif mode == "shared":
        notes.append(
            f"node {node.id}: {n} workers > {len(worker_cpus)} usable CPUs: "
            "CPUs are dealt round-robin, so some workers share a CPU"
        )
    return per_cpus


def _node_gpus(topo: Topology, node_id: int, *, compute_only: bool = False) -> tuple[str, ...]:
    return tuple(sorted(g.pci for g in topo.gpus
                        if g.numa_node == node_id and (not compute_only or is_compute_gpu(g))))


def _node_workers(
    topo: Topology,
    node: Node,
    reserved: tuple[int, ...],
    wpn: int | Literal["auto"],
    cpu_split: str,
    notes: list[str],
    shape: str = "node",
) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """(CPUs, GPUs) of each worker of one node; appends operator notes to ``notes``."""
    kept = set(reserved)
    worker_cpus = tuple(c for c in placeable_cpus(topo, node) if c not in kept)
    node_gpus = _node_gpus(topo, node.id)

    if shape == "gpu":
        gpus = _node_gpus(topo, node.id, compute_only=True)
        per_cpus = _split(topo, node, worker_cpus, len(gpus), cpu_split, notes)
        return [(cpus, (g,)) for cpus, g in zip(per_cpus, gpus)]
    if shape == "core":
        groups = physical_cores(topo, worker_cpus)
        return list(zip(groups, _deal_gpus(node, node_gpus, len(groups), notes)))
    if shape == "l3":
        groups = l3_slots(topo, node.id, worker_cpus)
        return list(zip(groups, _deal_gpus(node, node_gpus, len(groups), notes)))

    if wpn != "auto":
        n = wpn
    elif node_gpus:
        n = len(node_gpus)
        notes.append(f"node {node.id}: workers_per_node auto = {n} (one per GPU)")
    else:
        n = len(physical_cores(topo, worker_cpus))
        notes.append(f"node {node.id}: workers_per_node auto = {n} (one per physical core)")
    per_cpus = _split(topo, node, worker_cpus, n, cpu_split, notes)
    return list(zip(per_cpus, _deal_gpus(node, node_gpus, n, notes)))


# --- the plan ---------------------------------------------------------------------


def make_plan(
    topo: Topology,
    placement: PlacementConfig,
    *,
    nodes: str | Iterable[int] | None = None,
    workers_per_node: int | str | None = None,
) -> Plan:
    """Plan the worker slots for ``topo`` under ``placement``.

    ``nodes`` ("all", "0,2-3" or node ids) and ``workers_per_node`` (an
    integer or "auto") override the config's values when given.  Slots are
    numbered 0..n-1 in node-id order, then by index within the node; each
    slot's listener is its slot number.

    ``workers_per_node = "auto"``: the number of the node's GPUs when it has
    any (one worker per accelerator), else the number of physical cores (SMT
    siblings counted once) among the node's usable CPUs not reserved for IRQs
    (one worker per core).

    Memory policy ``bind`` is the default: hard locality, so a worker's pages
    never silently land on a remote node and latency stays predictable;
    ``preferred`` is the soft choice that spills to other nodes instead of a
    node-local OOM when a worker grows.

    Raises ``UsageError`` when an explicit node does not exist or cannot be
    used, when a value is invalid, or when no slot can be planned at all.
    """
    mempolicy = placement.mempolicy
    if mempolicy not in MEMPOLICIES:
        raise UsageError(f"mempolicy {mempolicy!r}: expected one of {', '.join(MEMPOLICIES)}")
    if placement.cpu_split not in CPU_SPLITS:
        raise UsageError(f"cpu_split {placement.cpu_split!r}: expected one of {', '.join(CPU_SPLITS)}")
    if placement.reserve_irq_cpus < 0:
        raise UsageError(f"reserve_irq_cpus {placement.reserve_irq_cpus}: expected an integer >= 0")
    wpn = parse_workers_per_node(placement.workers_per_node if workers_per_node is None else workers_per_node)
    requested = _requested_nodes(placement.nodes if nodes is None else nodes)
    shape = placement.slots
    check_shape(shape, wpn, placement.cpu_split)

    all_nodes = sorted(topo.nodes, key=lambda n: n.id)
    reasons = {n.id: _skip_reason(topo, n, mempolicy) for n in all_nodes}
    if shape == "gpu":
        for n in all_nodes:
            if reasons[n.id] is None and not _node_gpus(topo, n.id, compute_only=True):
                reasons[n.id] = 'no GPU (slots = "gpu")'
    usable = [n.id for n in all_nodes if reasons[n.id] is None]
    usable_text = format_nodes(usable)

    skipped: list[SkippedNode] = []
    if requested is None:
        planned = [n for n in all_nodes if reasons[n.id] is None]
        skipped = [SkippedNode(n.id, r) for n in all_nodes if (r := reasons[n.id]) is not None]
    else:
        by_id = {n.id: n for n in all_nodes}
        planned = []
        for nid in requested:
            if nid not in by_id:
                raise UsageError(
                    f"node {nid} does not exist; nodes on this machine: "
                    f"{format_nodes(by_id)}; usable: {usable_text}"
                )
            if reasons[nid] is not None:
                raise UsageError(f"node {nid} cannot be used: {reasons[nid]}; usable nodes: {usable_text}")
            planned.append(by_id[nid])

    if not planned and shape == "gpu" and not any(is_compute_gpu(g) for g in topo.gpus):
        found = ", ".join(f"{g.pci} (vendor {g.vendor}, display only)" for g in topo.gpus) or "none"
        raise UsageError(f'slots = "gpu": this machine has no compute GPU (PCI display/accelerator devices: {found})')
    if not planned:
        why = "; ".join(f"node {s.node}: {s.reason}" for s in skipped) or "the topology lists no nodes"
        raise UsageError(f"no node can take workers: {why}")

    notes: list[str] = []
    interleave = _interleave_nodes(topo, planned) if mempolicy == "interleave" else ()
    if mempolicy == "interleave" and not interleave:
        raise UsageError(
            "mempolicy interleave: none of the planned nodes' memory nodes is allowed and has memory "
            f"(allowed memory nodes: {format_nodes(topo.allowed_mems)})"
        )

    slots: list[SlotPlan] = []
    irq_cpus: dict[int, tuple[int, ...]] = {}
    k = placement.reserve_irq_cpus
    for node in planned:
        reserved, note = _reserve(topo, node, k)
        if note:
            notes.append(note)
        if reserved:
            irq_cpus[node.id] = reserved
        if mempolicy in ("bind", "preferred"):
            memory_nodes: tuple[int, ...] = (node.bind_node,)
        elif mempolicy == "interleave":
            memory_nodes = interleave
        else:
            memory_nodes = ()
        workers = _node_workers(topo, node, reserved, wpn, placement.cpu_split, notes, shape)
        for i, (cpus, gpus) in enumerate(workers):
            slot = len(slots)
            slots.append(
                SlotPlan(
                    slot=slot,
                    node=node.id,
                    index=i,
                    cpus=cpus,
                    mempolicy=mempolicy,
                    memory_nodes=memory_nodes,
                    gpus=gpus,
                    listener=slot,
                )
            )

    if shape == "gpu":
        notes.extend(_unplaced_gpu_notes(topo, {n.id for n in planned}, reasons))
        notes.extend(_unnamed_gpu_notes(topo, slots))
    if k > 0 and not any(_local_nic(topo, n.id) for n in planned):
        notes.append(f"reserve_irq_cpus = {k}: no planned node has a local NIC; nothing reserved")

    return Plan(
        slots=slots,
        skipped=skipped,
        notes=notes,
        mempolicy=mempolicy,
        workers_per_node=wpn,
        cpu_split=placement.cpu_split,
        irq_cpus=irq_cpus,
        shape=shape,
    )


def _unnamed_gpu_notes(topo: Topology, slots: Sequence[SlotPlan]) -> list[str]:
    """GPU slots whose GPU no visibility variable can name (vendor unknown to numaserve)."""
    vendor = {g.pci: (g.vendor or "").lower() for g in topo.gpus}
    return [
        f"slot {s.slot}: GPU {s.gpus[0]} (vendor {vendor.get(s.gpus[0]) or 'unknown'}): no visibility variable "
        f"known for it, the worker sees every device; set one in [env.slot.\"{s.slot}\"]"
        for s in slots if s.gpus and vendor.get(s.gpus[0]) not in GPU_VENDORS
    ]


def _unplaced_gpu_notes(topo: Topology, planned: set[int], reasons: dict[int, str | None]) -> list[str]:
    """Why a compute GPU got no slot under slots = "gpu" (unknown node, node not planned)."""
    notes = []
    for g in sorted(topo.gpus, key=lambda g: g.pci):
        if not is_compute_gpu(g) or g.numa_node in planned:
            continue
        if g.numa_node is None:
            notes.append(f"GPU {g.pci}: NUMA node unknown (sysfs numa_node -1): no slot")
        else:
            why = reasons.get(g.numa_node) or "not requested (placement.nodes)"
            notes.append(f"GPU {g.pci} gets no slot: its node {g.numa_node}: {why}")
    return notes
