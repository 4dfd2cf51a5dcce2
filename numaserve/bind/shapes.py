"""Slot shapes: how a node's CPUs are cut into worker slots.

``placement.slots`` = "node" (one worker per node, ``workers_per_node`` of
them), "core" (one per physical core, SMT siblings together), "l3" (one per
last-level cache group: an AMD CCX/CCD, or a whole socket's L3 on most Intel
parts) or "gpu" (one per GPU, on the GPU's node, seeing that GPU alone: the
layout of one vLLM/SGLang front end per GPU).  Memory binding is the slot's
node in every shape.  This module holds the checks and the groupings that do
not need the rest of placement; ``placement.make_plan`` puts them together.
"""

from __future__ import annotations

from typing import Sequence

from numaserve.cpulist import format_list
from numaserve.errors import UsageError
from numaserve.topology.model import Topology

__all__ = ["SLOT_SHAPES", "check_shape", "l3_slots"]

SLOT_SHAPES = ("node", "core", "l3", "gpu")


def check_shape(shape: str, workers_per_node: int | str, cpu_split: str) -> None:
    """UsageError when ``shape`` is unknown or a setting of the "node" shape is set with another one.

    ``workers_per_node`` other than 1 (the default) counts workers of a node,
    which the other shapes decide themselves: refused rather than ignored so
    a config never silently runs another number of workers than it says.
    ``cpu_split = "shared"`` makes no sense for core and L3 slots (their CPUs
    are the shape); for GPU slots it gives every slot all of the node's CPUs.
    """
    if shape not in SLOT_SHAPES:
        raise UsageError(f"slots {shape!r}: expected one of {', '.join(SLOT_SHAPES)}")
    if shape == "node":
        return
    if workers_per_node != 1:
        per = {"core": "physical core", "l3": "L3 cache group", "gpu": "GPU"}[shape]
        raise UsageError(
            f"workers_per_node = {workers_per_node!r} applies to slots = \"node\" only: slots = \"{shape}\" "
            f"places one worker per {per}; remove workers_per_node or use slots = \"node\""
        )
    if cpu_split == "shared" and shape in ("core", "l3"):
        raise UsageError(
            f"cpu_split = \"shared\" does not apply to slots = \"{shape}\" (each slot's CPUs are its "
            f"{'core' if shape == 'core' else 'L3 group'}); use cpu_split = \"split\""
        )


def l3_slots(topo: Topology, node_id: int, cpus: Sequence[int]) -> list[tuple[int, ...]]:
    """``cpus`` grouped by the L3 cache they share, ordered by first CPU.

    An L3 spanning two nodes (sub-NUMA clustering) is cut at the node: a
    slot never crosses its memory node.  UsageError when a CPU has no L3
    entry in sysfs, naming the CPUs and the files.
    """
    l3 = topo.cpu_facts.l3
    missing = [c for c in cpus if c not in l3]
    if missing:
        raise UsageError(
            f"slots = \"l3\": no L3 cache information for CPU(s) {format_list(missing)} of node {node_id} "
            f"(sys/devices/system/cpu/cpuN/cache/index*/level = 3 with shared_cpu_list); use slots = \"core\" "
            f"or \"node\""
        )
    wanted = set(cpus)
    groups: dict[tuple[int, ...], None] = {}
    for c in sorted(wanted):
        groups.setdefault(tuple(x for x in l3[c] if x in wanted), None)
    return sorted(groups, key=lambda g: g[0])
