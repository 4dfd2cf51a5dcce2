"""Why each CPU and node of a plan is used or skipped.

Why: a plan lists only what was chosen; on a machine where a node or half the
CPUs got nothing, the operator needs the reason (cgroup cpuset, offline,
isolcpus, an SMT sibling forbidden, a memory-less node, IRQ reservation).
Pure: Topology + Plan in, ``Finding`` (subject, verdict, reason) out.
``plan --explain`` prints them; ``doctor`` sums them up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Sequence

from numaserve.bind.placement import Plan
from numaserve.cpulist import format_list
from numaserve.topology.model import Topology

__all__ = ["Finding", "cpu_findings", "node_findings", "group_cpus", "format_findings"]

FindingVerdict = Literal["used", "skipped", "fail", "warn", "info"]


@dataclass(frozen=True)
class Finding:
    """One explained subject: "cpu 3", "cpus 16-127", "node 1", or a doctor check id."""

    subject: str
    verdict: FindingVerdict
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"subject": self.subject, "verdict": self.verdict, "reason": self.reason}


def _slot_text(slots: Sequence[int]) -> str:
    return f"slot {slots[0]}" if len(slots) == 1 else f"slots {format_list(slots)}"


def cpu_findings(topo: Topology, plan: Plan) -> list[Finding]:
    """One finding per present CPU (online or offline), in CPU order."""
    owners: dict[int, list[int]] = {}
    for s in plan.slots:
        for c in s.cpus:
            owners.setdefault(c, []).append(s.slot)
    reserved = {c: n for n, cpus in plan.irq_cpus.items() for c in cpus}
    node_of = topo.cpu_node()
    skipped = {s.node: s.reason for s in plan.skipped}
    planned = set(plan.nodes)
    allowed = set(topo.allowed_cpus)
    isolated, nohz = set(topo.cpu_facts.isolated), set(topo.cpu_facts.nohz_full)
    offline = set(topo.cpu_facts.offline) - set(topo.online_cpus)
    out: list[Finding] = []
    for c in sorted(set(topo.online_cpus) | offline):
        subject = f"cpu {c}"
        node = node_of.get(c)
        where = f" (node {node})" if node is not None else ""
        if c in offline:
            out.append(Finding(subject, "skipped", "offline (present, not online)"))
        elif c in owners:
            extra = "; nohz_full: the tick keeps running while the worker's threads share it" if c in nohz else ""
            out.append(Finding(subject, "used", f"{_slot_text(owners[c])}{where}{extra}"))
        elif c in reserved:
            out.append(Finding(subject, "skipped", f"reserved for NIC IRQs of node {reserved[c]} (reserve_irq_cpus)"))
        elif c not in allowed:
            used_siblings = sorted(s for s in topo.smt_siblings.get(c, ()) if s != c and s in owners)
            why = "not allowed: outside this process's CPU affinity / cgroup cpuset.cpus"
            if used_siblings:
                why = (f"SMT sibling of CPU {format_list(used_siblings)} left out: {why}; "
                       f"the core runs {_slot_text(owners[used_siblings[0]])} on one thread")
            out.append(Finding(subject, "skipped", why))
        elif c in isolated:
            out.append(Finding(subject, "skipped", "isolated (isolcpus): no load balancing there"))
        elif node is None:
            out.append(Finding(subject, "skipped", "on no NUMA node"))
        elif node in skipped:
            out.append(Finding(subject, "skipped", f"node {node} skipped: {skipped[node]}"))
        elif node not in planned:
            out.append(Finding(subject, "skipped", f"node {node} not requested (placement.nodes)"))
        else:
            out.append(Finding(subject, "skipped", f"given to no slot of node {node} (slots = {plan.shape})"))
    return out


def node_findings(topo: Topology, plan: Plan) -> list[Finding]:
    """One finding per node: its slots, or why it has none."""
    skipped = {s.node: s.reason for s in plan.skipped}
    out: list[Finding] = []
    for n in sorted(topo.nodes, key=lambda x: x.id):
        subject = f"node {n.id}"
        slots = [s for s in plan.slots if s.node == n.id]
        if slots:
            cpus = sorted({c for s in slots for c in s.cpus})
            why = f"{_slot_text([s.slot for s in slots])} on CPUs {format_list(cpus)}"
            if not n.has_memory:
                why += "; the node has no memory: every access is remote"
            elif n.bind_node != n.id:
                why += f"; memory from node {n.bind_node} (declared memory_node)"
            out.append(Finding(subject, "used", why))
        elif n.id in skipped:
            out.append(Finding(subject, "skipped", skipped[n.id]))
        else:
            out.append(Finding(subject, "skipped", "not requested (placement.nodes)"))
    return out


def group_cpus(findings: Sequence[Finding]) -> list[Finding]:
    """"cpu N" findings with the same verdict and reason folded into one "cpus A-B,..."
    finding (in order of first appearance); other findings pass through after them."""
    groups: dict[tuple[str, str], list[int]] = {}
    rest: list[Finding] = []
    for f in findings:
        if f.subject.startswith("cpu "):
            groups.setdefault((f.verdict, f.reason), []).append(int(f.subject[4:]))
        else:
            rest.append(f)
    folded = [
        Finding(f"cpu {cpus[0]}" if len(cpus) == 1 else f"cpus {format_list(cpus)}", verdict, reason)  # type: ignore[arg-type]
        for (verdict, reason), cpus in groups.items()
    ]
    return folded + rest


def format_findings(findings: Sequence[Finding]) -> str:
    """Findings as aligned text lines: subject, verdict, reason."""
    if not findings:
        return ""
    sw = max(len(f.subject) for f in findings)
    vw = max(len(f.verdict) for f in findings)
    return "\n".join(f"  {f.subject:<{sw}}  {f.verdict:<{vw}}  {f.reason}" for f in findings)
