"""A declared topology: a TOML file that replaces or corrects what sysfs says.

Why: firmware lies (one node for two sockets, NICs at ``numa_node = -1``),
and a one-node machine must still be able to exercise multi-node plans
(tests map this 2-CPU VM onto two pretend nodes).

Format::

    mode = "replace"          # "replace" (default): only these nodes exist
                              # "correct": patch the sysfs nodes listed, keep the others
    [[node]]
    id = 0                    # pretend (or corrected) node id, an integer >= 0
    cpus = "0"                # cpulist string (or a list of ints); online CPUs only.
                              # Required in "replace" mode and for new ids in "correct".
    memory_node = 0           # real node whose memory workers placed here bind to
                              # (default: id, which must then be a real node)
    [[node]]
    id = 1
    cpus = "1"
    memory_node = 0

    [nic.eth0]
    node = 1                  # NIC -> node override (a node of the resulting topology)

Semantics:

* Memory total/free, hugepages and ``has_memory`` of a node come from its
  ``memory_node``'s sysfs entry; ``memory_allowed`` from the cgroup.
* Distances: 10 on the diagonal and between nodes sharing a memory node,
  else the real distance between their memory nodes (20 when unknown).
* "correct": a listed id that exists in sysfs is patched (``cpus`` and/or
  ``memory_node``); its CPUs are taken away from the other sysfs nodes.  A
  new id adds a node.  Unlisted sysfs nodes stay as they are.
* ``Topology.possible_nodes`` and ``allowed_mems`` keep the *real* node ids
  (they size and bound memory policies); a node's memory target is
  ``Node.bind_node``.
* A NIC's sysfs ``numa_node`` N still counts in "replace" mode when exactly
  one declared node has ``memory_node`` N; otherwise its ``local_cpulist``
  decides.

Every error (unreadable file, bad TOML, unknown key, wrong type, bad mode,
duplicate id, CPU in two nodes, CPU not online, unknown memory node or NIC
node) raises ``UsageError`` naming the file, the key and the bad value.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Mapping, Sequence

from numaserve.cpulist import ListSyntaxError, format_list, parse_list
from numaserve.errors import UsageError
from numaserve.topology.model import Node

__all__ = ["Declared", "DeclaredNode", "load_declared", "apply_declared", "declared_sysfs_map", "node_distance"]

Mode = Literal["replace", "correct"]
_TOP_KEYS = ("mode", "nic", "node")
_NODE_KEYS = ("cpus", "id", "memory_node")
_NIC_KEYS = ("node",)


@dataclass(frozen=True)
class DeclaredNode:
    index: int  # position in the file, for messages: node[index]
    id: int
    cpus: tuple[int, ...] | None
    cpus_text: Any = None
    memory_node: int | None = None


@dataclass(frozen=True)
class Declared:
    path: str
    mode: Mode
    nodes: tuple[DeclaredNode, ...]
    nics: dict[str, int] = field(default_factory=dict)

    def error(self, key: str, value: Any, why: str) -> UsageError:
        return UsageError(f"{self.path}: {key} = {value!r}: {why}")


def _err(path: str, key: str, value: Any, why: str) -> UsageError:
    return UsageError(f"{path}: {key} = {value!r}: {why}")


def _unknown_keys(path: str, where: str, table: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    for k in table:
        if k not in allowed:
            prefix = f"{where}." if where else ""
            raise UsageError(f"{path}: unknown key {prefix}{k}: expected one of {', '.join(allowed)}")


def _int(path: str, key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise _err(path, key, v, "expected an integer >= 0")
    return v


def _cpus(path: str, key: str, v: Any) -> tuple[int, ...]:
    if isinstance(v, str):
        try:
            return parse_list(v)
        except ListSyntaxError as e:
            raise _err(path, key, v, f"expected a cpulist like \"0-3,8\" ({e})") from None
    if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        return tuple(sorted(set(v)))
    raise _err(path, key, v, 'expected a cpulist string like "0-3,8" or a list of CPU numbers')


def load_declared(path: str) -> Declared:
    """Read and check a declared topology file (shape only; ``apply_declared`` checks it
    against the machine)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise UsageError(f"{path}: declared topology file not found") from None
    except OSError as e:
        raise UsageError(f"{path}: cannot read declared topology file: {e.strerror}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path}: invalid TOML: {e}") from None

    _unknown_keys(path, "", data, _TOP_KEYS)
    mode = data.get("mode", "replace")
    if mode not in ("replace", "correct"):
        raise _err(path, "mode", mode, 'expected "replace" or "correct"')

    raw_nodes = data.get("node", [])
    if not isinstance(raw_nodes, list) or not all(isinstance(t, dict) for t in raw_nodes):
        raise _err(path, "node", raw_nodes, "expected [[node]] tables")
    if mode == "replace" and not raw_nodes:
        raise UsageError(f'{path}: mode = "replace" needs at least one [[node]]')
    nodes: list[DeclaredNode] = []
    seen_ids: dict[int, int] = {}
    cpu_owner: dict[int, int] = {}
    for i, t in enumerate(raw_nodes):
        where = f"node[{i}]"
        _unknown_keys(path, where, t, _NODE_KEYS)
        if "id" not in t:
            raise UsageError(f"{path}: {where}: missing key id")
        nid = _int(path, f"{where}.id", t["id"])
        if nid in seen_ids:
            raise _err(path, f"{where}.id", nid, f"duplicate node id (also node[{seen_ids[nid]}])")
        seen_ids[nid] = i
        cpus: tuple[int, ...] | None = None
        if "cpus" in t:
            cpus = _cpus(path, f"{where}.cpus", t["cpus"])
            for c in cpus:
                if c in cpu_owner:
                    raise _err(path, f"{where}.cpus", t["cpus"], f"CPU {c} is already in node {cpu_owner[c]}")
                cpu_owner[c] = nid
        elif mode == "replace":
            raise UsageError(f'{path}: {where} (id {nid}): missing key cpus (required in mode "replace")')
        mem = _int(path, f"{where}.memory_node", t["memory_node"]) if "memory_node" in t else None
        nodes.append(DeclaredNode(index=i, id=nid, cpus=cpus, cpus_text=t.get("cpus"), memory_node=mem))

    raw_nics = data.get("nic", {})
    if not isinstance(raw_nics, dict):
        raise _err(path, "nic", raw_nics, "expected [nic.<interface>] tables")
    nics: dict[str, int] = {}
    for name, t in raw_nics.items():
        if not isinstance(t, dict):
            raise _err(path, f"nic.{name}", t, "expected a table with node = N")
        _unknown_keys(path, f"nic.{name}", t, _NIC_KEYS)
        if "node" not in t:
            raise UsageError(f"{path}: nic.{name}: missing key node")
        nics[name] = _int(path, f"nic.{name}.node", t["node"])
    return Declared(path=path, mode=mode, nodes=tuple(nodes), nics=nics)


def node_distance(a: Node, b: Node, real: Mapping[int, Node]) -> int:
    """10 for the same node or the same memory node, else the real distance of the
    memory nodes (20 when sysfs did not say)."""
    if a.id == b.id or a.bind_node == b.bind_node:
        return 10
    src = real.get(a.bind_node)
    return src.distances.get(b.bind_node, 20) if src is not None else 20


def _memory_from(node: Node, src: Node, allowed_mems: Sequence[int]) -> Node:
    return replace(
        node,
        memory_total_bytes=src.memory_total_bytes,
        memory_free_bytes=src.memory_free_bytes,
        hugepages=src.hugepages,
        has_memory=src.has_memory,
        memory_node=None if src.id == node.id else src.id,
        memory_allowed=src.id in allowed_mems,
    )


def apply_declared(
    decl: Declared,
    real_nodes: Sequence[Node],
    online_cpus: Sequence[int],
    allowed_cpus: Sequence[int],
    allowed_mems: Sequence[int],
) -> list[Node]:
    """The node list after replacing or correcting ``real_nodes`` (from sysfs)."""
    real = {n.id: n for n in real_nodes}
    real_ids = format_list(real) or "none"
    online = set(online_cpus)
    for d in decl.nodes:
        for c in d.cpus or ():
            if c not in online:
                raise decl.error(
                    f"node[{d.index}].cpus", d.cpus_text, f"CPU {c} is not online (online: {format_list(online)})"
                )

    def memory_source(d: DeclaredNode) -> Node:
        mem = d.memory_node if d.memory_node is not None else d.id
        if mem not in real:
            if d.memory_node is None:
                raise decl.error(
                    f"node[{d.index}].id", d.id,
                    f"not a node of this machine (nodes: {real_ids}); set memory_node to a real node",
                )
            raise decl.error(f"node[{d.index}].memory_node", mem, f"not a node of this machine (nodes: {real_ids})")
        return real[mem]

    if decl.mode == "replace":
        out: dict[int, Node] = {}
        for d in decl.nodes:
            base = Node(id=d.id, cpus=tuple(d.cpus or ()), usable_cpus=(), memory_total_bytes=None,
                        memory_free_bytes=None)
            out[d.id] = _memory_from(base, memory_source(d), allowed_mems)
    else:
        out = {n.id: replace(n, distances=dict(n.distances)) for n in real_nodes}
        claimed = {c for d in decl.nodes for c in (d.cpus or ())}
        listed = {d.id for d in decl.nodes if d.cpus is not None}
        for nid, n in out.items():
            if nid not in listed and claimed & set(n.cpus):
                out[nid] = replace(n, cpus=tuple(c for c in n.cpus if c not in claimed))
        for d in decl.nodes:
            if d.id in out:
                n = out[d.id]
                if d.cpus is not None:
                    n = replace(n, cpus=d.cpus)
                if d.memory_node is not None:
                    n = _memory_from(n, memory_source(d), allowed_mems)
            else:
                if d.cpus is None:
                    raise decl.error(
                        f"node[{d.index}].id", d.id, f"not a node of this machine (nodes: {real_ids}); a new node needs cpus"
                    )
                n = Node(id=d.id, cpus=d.cpus, usable_cpus=(), memory_total_bytes=None, memory_free_bytes=None)
                n = _memory_from(n, memory_source(d), allowed_mems)
            out[d.id] = n

    allowed = set(allowed_cpus)
    nodes = [replace(n, usable_cpus=tuple(c for c in n.cpus if c in allowed)) for _, n in sorted(out.items())]
    for n in nodes:
        n.distances = {m.id: node_distance(n, m, real) for m in nodes}
    ids = {n.id for n in nodes}
    for name, nid in decl.nics.items():
        if nid not in ids:
            raise decl.error(f"nic.{name}.node", nid, f"no such node (nodes: {format_list(ids)})")
    return nodes


def declared_sysfs_map(decl: Declared, nodes: Sequence[Node]) -> Callable[[int], int | None]:
    """How a device's sysfs ``numa_node`` maps onto the declared nodes.

    "correct" keeps node ids, so N is N when it is still a node.  "replace"
    invents ids: N counts only when exactly one node has memory node N.
    """
    ids = {n.id for n in nodes}
    if decl.mode == "correct":
        return lambda nid: nid if nid in ids else None

    def by_memory(nid: int) -> int | None:
        homes = [n.id for n in nodes if n.bind_node == nid]
        return homes[0] if len(homes) == 1 else None

    return by_memory
