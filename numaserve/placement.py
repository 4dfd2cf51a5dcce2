"""Topology + Config → Plan: which worker slots exist and how each is bound.

Pure: takes data, returns data.  ``make_plan`` raises ``UsageError`` (exit 2)
for a request that cannot be satisfied on this machine (a node that does not
exist or this process may not use), naming the usable nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    slots: list[SlotPlan]
    skipped: list[SkippedNode] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    mempolicy: str = "bind"
    workers_per_node: int | str = 1

    def to_json(self) -> dict[str, Any]:
        return {
            "slots": [s.to_json() for s in self.slots],
            "skipped": [{"node": s.node, "reason": s.reason} for s in self.skipped],
            "notes": list(self.notes),
            "mempolicy": self.mempolicy,
            "workers_per_node": self.workers_per_node,
        }
