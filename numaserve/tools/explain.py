"""Placement explained: why each CPU and node is used or skipped, and what works
against the binding.

Why: ``numaserve plan --explain`` puts the plan's own reasons
(``bind.explain``) next to the host settings that quietly undo a binding
(automatic NUMA balancing, irqbalance, THP collapse, sub-NUMA clustering,
memory-less nodes).  Those are doctor's own checks, so ``plan --explain``
and ``doctor`` never disagree.  Pure: Topology + Plan + Config in, findings out.
"""

from __future__ import annotations

from numaserve.bind.explain import Finding, cpu_findings, group_cpus, node_findings
from numaserve.bind.placement import Plan
from numaserve.config import Config
from numaserve.net.irq import IrqSettings
from numaserve.tools.doctor import (
    Check,
    check_irqbalance,
    check_memory_nodes,
    check_numa_balancing,
    check_sub_numa,
    check_thp,
    check_thp_defrag,
)
from numaserve.topology.model import Topology

__all__ = ["placement_checks", "hazards", "explain"]


def placement_checks(topo: Topology, config: Config) -> list[Check]:
    """Doctor's checks for what works against a binding (the same functions doctor runs)."""
    irq = getattr(config, "irq", None)
    if not isinstance(irq, IrqSettings):
        irq = IrqSettings()
    return [
        check_numa_balancing(topo, config),
        check_irqbalance(topo, irq),
        check_thp(topo),
        check_thp_defrag(topo, config),
        check_sub_numa(topo),
        check_memory_nodes(topo),
    ]


def hazards(topo: Topology, config: Config) -> list[Finding]:
    """The placement checks that are not ok, as findings (subject = doctor's check id)."""
    return [Finding(c.id, c.verdict, c.summary) for c in placement_checks(topo, config) if c.verdict != "ok"]


def explain(topo: Topology, plan: Plan, config: Config) -> list[Finding]:
    """CPUs (folded into runs), then nodes, then host settings against the binding."""
    return group_cpus(cpu_findings(topo, plan)) + node_findings(topo, plan) + hazards(topo, config)
