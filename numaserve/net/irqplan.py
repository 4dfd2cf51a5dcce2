"""NIC IRQ plan (pure): Topology + ``[irq]`` settings → which CPUs each queue interrupt goes to.

No file access here: ``numaserve.net.irq`` applies a plan (and restores it),
``numaserve.cli.irq_cmd`` shows it.  Queue interrupts are spread over the
NIC node's usable CPUs (cores before SMT siblings), or only over the CPUs
``placement.reserve_irq_cpus`` keeps from workers; every NIC or IRQ left out
says why (``SkippedIrq``).  irqbalance would overwrite the plan within
seconds, so a plan knows how to refuse (``IrqbalanceConflict``) with the fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

from numaserve.config import IrqSettings
from numaserve.cpulist import format_list, format_mask
from numaserve.errors import NumaserveError, UsageError
from numaserve.topology.model import Irq, Nic, Topology

__all__ = ["IrqEntry", "IrqPlan", "IrqbalanceConflict", "QueueFileEntry", "SkippedIrq", "irqbalance_fixes",
           "irqbalance_message", "order_cores_first", "plan_irqs"]


# --- plan (pure) ----------------------------------------------------------------


@dataclass(frozen=True)
class IrqEntry:
    """One queue IRQ to steer.  ``candidates`` is the NIC's whole CPU set in
    preference order (used to retry elsewhere on ENOSPC)."""

    irq: int
    name: str | None
    nic: str
    queue: int | None
    current: tuple[int, ...] | None
    target: tuple[int, ...]
    candidates: tuple[int, ...]

    @property
    def changed(self) -> bool:
        return self.current != self.target

    def to_json(self) -> dict[str, Any]:
        return {
            "irq": self.irq,
            "name": self.name,
            "nic": self.nic,
            "queue": self.queue,
            "current": None if self.current is None else format_list(self.current),
            "target": format_list(self.target),
            "changed": self.changed,
        }


@dataclass(frozen=True)
class QueueFileEntry:
    """An RPS (``rx-N/rps_cpus``) or XPS (``tx-N/xps_cpus``) mask to write.

    ``path`` is relative to the root.  The file may be absent (XPS on some
    virtio guests): apply tolerates that.
    """

    nic: str
    kind: Literal["rps", "xps"]
    queue: int
    path: str
    cpus: tuple[int, ...]

    @property
    def mask(self) -> str:
        return format_mask(self.cpus)

    def to_json(self) -> dict[str, Any]:
        return {
            "nic": self.nic,
            "kind": self.kind,
            "queue": self.queue,
            "path": self.path,
            "cpus": format_list(self.cpus),
            "mask": self.mask,
        }


@dataclass(frozen=True)
class SkippedIrq:
    """A NIC or IRQ left alone, with the reason (and the fix, when there is one)."""

    nic: str
    irq: int | None
    name: str | None
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"nic": self.nic, "irq": self.irq, "name": self.name, "reason": self.reason}


@dataclass
class IrqPlan:
    entries: list[IrqEntry] = field(default_factory=list)
    skipped: list[SkippedIrq] = field(default_factory=list)
    queue_files: list[QueueFileEntry] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    policy: str = "shared"
    irqbalance_mode: str = "refuse"
    irqbalance_running: bool | None = None
    irqbalance_pids: tuple[int, ...] = ()

    @property
    def changes(self) -> list[IrqEntry]:
        return [e for e in self.entries if e.changed]

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "entries": [e.to_json() for e in self.entries],
            "skipped": [s.to_json() for s in self.skipped],
            "queue_files": [q.to_json() for q in self.queue_files],
            "warnings": list(self.warnings),
            "irqbalance": {
                "running": self.irqbalance_running,
                "pids": list(self.irqbalance_pids),
                "mode": self.irqbalance_mode,
            },
        }


def order_cores_first(cpus: Sequence[int], smt_siblings: Mapping[int, Sequence[int]]) -> tuple[int, ...]:
    """Order CPUs so every physical core's first thread comes before any second thread.

    Why: scaling.rst — "for interrupt handling, HT has shown no benefit", so
    the first N queues get N distinct cores and siblings are used only when
    there are more queues than cores.  ``smt_siblings`` maps a CPU to its
    ``thread_siblings_list`` (itself included); missing CPUs count as their
    own core.
    """
    chosen = set(cpus)
    cores: dict[tuple[int, ...], list[int]] = {}
    for c in sorted(chosen):
        key = tuple(sorted(set(smt_siblings.get(c, (c,))) | {c}))
        cores.setdefault(key, []).append(c)
    ordered_cores = sorted(cores.values(), key=lambda members: members[0])
    out: list[int] = []
    depth = max((len(m) for m in ordered_cores), default=0)
    for rank in range(depth):
        out.extend(m[rank] for m in ordered_cores if rank < len(m))
    return tuple(out)


def _nic_cpus(topo: Topology, nic: Nic, base: Sequence[int]) -> tuple[int, ...]:
    """``base`` ∩ local_cpus ∩ online ∩ allowed (FACTS §5.3).

    A NIC whose node was *declared* by the operator ignores sysfs local_cpus:
    the declaration exists because firmware locality is wrong or absent.
    """
    s = set(base) & set(topo.online_cpus) & set(topo.allowed_cpus)
    if nic.local_cpus and nic.numa_node_source != "declared":
        s &= set(nic.local_cpus)
    return tuple(sorted(s))


def _queue_order(irqs: Sequence[Irq]) -> dict[int, int]:
    """IRQ → position in the round-robin.  IRQs of the same queue (virtio
    input.N/output.N, rx-N/tx-N) share a position so they land on one CPU;
    queue IRQs with no number follow the numbered ones."""
    numbered = sorted({i.queue for i in irqs if i.queue is not None})
    pos = {q: k for k, q in enumerate(numbered)}
    out: dict[int, int] = {}
    nxt = len(numbered)
    for i in sorted(irqs, key=lambda i: i.irq):
        if i.queue is not None:
            out[i.irq] = pos[i.queue]
        else:
            out[i.irq] = nxt
            nxt += 1
    return out


def plan_irqs(
    topo: Topology,
    settings: IrqSettings | None = None,
    *,
    iface: str | None = None,
    reserved: Mapping[int, Sequence[int]] | None = None,
) -> IrqPlan:
    """Decide where every queue IRQ of every steerable NIC goes.  Pure.

    ``iface`` (a CLI flag) narrows to one NIC and wins over
    ``settings.interfaces``; an unknown name is a ``UsageError``.
    ``reserved`` maps node → CPUs kept for IRQs (``placement.reserved_irq_cpus``)
    and is used only with ``policy = "reserved"``.
    """
    settings = settings or IrqSettings()
    sysinfo = topo.system
    plan = IrqPlan(
        policy=settings.policy,
        irqbalance_mode=settings.irqbalance,
        irqbalance_running=sysinfo.irqbalance_running,
        irqbalance_pids=tuple(sysinfo.irqbalance_pids),
    )
    names = [n.name for n in topo.nics]
    wanted: list[str] | None
    if iface is not None:
        wanted = [iface]
    elif settings.interfaces:
        wanted = list(settings.interfaces)
    else:
        wanted = None
    if wanted is not None:
        missing = [w for w in wanted if w not in names]
        if missing:
            raise UsageError(
                f"irq: no physical NIC named {', '.join(missing)}; "
                f"found: {', '.join(names) if names else '(none)'}"
            )
    nics = [n for n in topo.nics if wanted is None or n.name in wanted]
    if not nics:
        plan.warnings.append("no physical NIC found: nothing to steer")

    for nic in nics:
        _plan_nic(topo, nic, settings, reserved, plan)
    return plan


def _skip_nic(plan: IrqPlan, nic: Nic, msg: str) -> None:
    """A NIC left alone: a warning for the operator and a skipped entry with the reason."""
    plan.warnings.append(msg)
    plan.skipped.append(SkippedIrq(nic.name, None, None, msg))


def _plan_nic(
    topo: Topology,
    nic: Nic,
    settings: IrqSettings,
    reserved: Mapping[int, Sequence[int]] | None,
    plan: IrqPlan,
) -> None:
    if nic.numa_node is None:
        msg = (
            f"{nic.name}: NUMA node unknown (sysfs numa_node -1 and local_cpulist covers all CPUs); "
            f"not steering its IRQs. Fix: declare it in a declared topology file: "
            f"[nic.{nic.name}] node = N"
        )
        _skip_nic(plan, nic, msg)
        return
    try:
        node = topo.node(nic.numa_node)
    except KeyError:
        msg = f"{nic.name}: NUMA node {nic.numa_node} is not in the topology; not steering"
        _skip_nic(plan, nic, msg)
        return
    shared = _nic_cpus(topo, nic, node.cpus)
    if settings.policy == "reserved":
        rset = tuple((reserved or {}).get(node.id, ()))
        cpus = _nic_cpus(topo, nic, set(rset) & set(node.cpus))
        if not cpus:
            msg = (
                f"{nic.name}: policy \"reserved\" but no usable reserved CPU on node {node.id} "
                f"(reserved: {format_list(rset) or 'none'}); set placement.reserve_irq_cpus > 0 "
                f"or use policy \"shared\""
            )
            _skip_nic(plan, nic, msg)
            return
    else:
        cpus = shared
    if not cpus:
        msg = (
            f"{nic.name}: no usable CPU on node {node.id} (node CPUs {format_list(node.cpus) or 'none'} "
            f"∩ NIC local CPUs ∩ online ∩ allowed is empty); not steering"
        )
        _skip_nic(plan, nic, msg)
        return
    ordered = order_cores_first(cpus, topo.smt_siblings)

    queue_irqs = []
    for irq in sorted(nic.irqs, key=lambda i: i.irq):
        if irq.kind == "queue":
            queue_irqs.append(irq)
        elif irq.kind == "admin":
            plan.skipped.append(SkippedIrq(nic.name, irq.irq, irq.name, "admin vector (config/async): left alone"))
        else:
            plan.skipped.append(
                SkippedIrq(
                    nic.name, irq.irq, irq.name,
                    "cannot tell from its name whether it is a queue vector: left alone",
                )
            )
    if not queue_irqs:
        plan.warnings.append(f"{nic.name}: no queue IRQ found (INTx or unknown names): nothing to steer")

    position = _queue_order(queue_irqs)
    queue_cpu: dict[int, int] = {}
    for irq in queue_irqs:
        p = position[irq.irq]
        cpu = ordered[p % len(ordered)]
        if irq.queue is not None:
            queue_cpu.setdefault(irq.queue, cpu)
        rest = tuple(c for c in ordered if c != cpu)
        plan.entries.append(
            IrqEntry(
                irq=irq.irq,
                name=irq.name,
                nic=nic.name,
                queue=irq.queue,
                current=irq.affinity,
                target=(cpu,),
                candidates=(cpu,) + rest,
            )
        )

    base = f"sys/class/net/{nic.name}/queues"
    if settings.rps:
        for q in range(nic.rx_queues):
            plan.queue_files.append(QueueFileEntry(nic.name, "rps", q, f"{base}/rx-{q}/rps_cpus", shared))
    if settings.xps:
        for q in range(nic.tx_queues):
            cpu = queue_cpu.get(q, ordered[q % len(ordered)])
            plan.queue_files.append(QueueFileEntry(nic.name, "xps", q, f"{base}/tx-{q}/xps_cpus", (cpu,)))


# --- irqbalance --------------------------------------------------------------------


def irqbalance_fixes(irqs: Sequence[int], cpus: Sequence[int]) -> list[str]:
    """The exact lines an operator adds so irqbalance leaves our IRQs alone.

    ``--banirq`` is precise (irqbalance never touches a banned IRQ);
    ``IRQBALANCE_BANNED_CPULIST`` additionally keeps *other* IRQs off the
    steered CPUs (useful with policy "reserved").  Both need a restart.
    """
    fixes: list[str] = []
    if irqs:
        args = " ".join(f"--banirq={i}" for i in sorted(set(irqs)))
        fixes.append(f'IRQBALANCE_ARGS="{args}"   (in /etc/default/irqbalance or /etc/sysconfig/irqbalance)')
    if cpus:
        fixes.append(
            f"IRQBALANCE_BANNED_CPULIST={format_list(cpus)}   (same file; keeps other IRQs off these CPUs)"
        )
    fixes.append("then: systemctl restart irqbalance")
    return fixes


class IrqbalanceConflict(NumaserveError):
    """irqbalance is running and the settings say refuse: applying would be undone in ~10 s."""


def irqbalance_message(plan: IrqPlan) -> str:
    pids = ", ".join(str(p) for p in plan.irqbalance_pids) or "unknown pid"
    irqs = [e.irq for e in plan.entries]
    cpus = sorted({c for e in plan.entries for c in e.target})
    lines = [
        f"irqbalance is running (pid {pids}); it rebalances every 10 s and would overwrite these "
        f"affinities. Not applying (irq.irqbalance = \"refuse\"). Fixes (numaserve never kills it):",
    ]
    lines += [f"  {f}" for f in irqbalance_fixes(irqs, cpus)]
    lines.append("  or apply anyway: numaserve irq apply --force-with-irqbalance (or irq.irqbalance = \"warn\")")
    return "\n".join(lines)
