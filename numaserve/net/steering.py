"""Classic-BPF reuseport steering: send each connection to a listener on the
NUMA node of the CPU that received it.

Why: with one SO_REUSEPORT socket per worker slot, the kernel picks a socket
by hash, so half the connections of a 2-node box land on a worker of the
other node.  A tiny CBPF program attached to the group returns, for the CPU
running the RX softirq (``SKF_AD_CPU``), the *group position* of a healthy
socket of that CPU's node.  A miss returns 0xFFFFFFFF, which is >= the group
size, so the kernel falls back to its hash (FACTS §7.1, §7.4).

* ``numa_cpu_to_slot`` (pure): CPU → node → a healthy slot of that node →
  its position in the reuseport group.
* ``build_cpu_table_program`` (pure): the table program, exactly FACTS §7.4.
* ``attach_reuseport_cbpf`` / ``detach_reuseport_bpf``: the setsockopt shell.
* ``hot_set`` (pure): while a node has more healthy slots than CPUs, the
  few that take its new connections (the way a shared accept queue keeps a
  few processes hot), so a crowd of workers on few CPUs batches requests
  per wake-up instead of waking every interpreter per request.
* ``loopback_collapse_check`` (pure): detects nginx#150 — every connection
  on one slot because one CPU runs every softirq (loopback, single-queue
  NIC) — so the supervisor can detach the program and fall back to hashing.

Group positions: TCP sockets join the group at ``listen()`` in order;
closing one moves the *last* socket into the hole.  Any membership change
means: recompute ``group_index`` and reattach.
"""

from __future__ import annotations

import ctypes
import errno
import socket
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Sequence

__all__ = [
    "SO_ATTACH_REUSEPORT_CBPF",
    "SO_DETACH_REUSEPORT_BPF",
    "SKF_AD_OFF",
    "SKF_AD_CPU",
    "BPF_MAXINSNS",
    "HASH_FALLBACK",
    "ProgramTooLarge",
    "build_cpu_table_program",
    "numa_cpu_to_slot",
    "attach_reuseport_cbpf",
    "detach_reuseport_bpf",
    "group_positions_after_close",
    "CollapseVerdict",
    "loopback_collapse_check",
    "build_selection_program",
    "hot_set",
]

# <asm-generic/socket.h> (x86_64, aarch64)
SO_ATTACH_REUSEPORT_CBPF = 51
SO_DETACH_REUSEPORT_BPF = 68
# <linux/filter.h>, <linux/bpf_common.h>
BPF_LD, BPF_W, BPF_ABS = 0x00, 0x00, 0x20
BPF_JMP, BPF_JEQ, BPF_K = 0x05, 0x10, 0x00
BPF_RET = 0x06
SKF_AD_OFF = -0x1000
SKF_AD_CPU = 36
SKF_NET_OFF = -0x100000
BPF_LDX, BPF_B, BPF_H, BPF_IND, BPF_MSH = 0x01, 0x10, 0x08, 0x40, 0xA0
BPF_ALU, BPF_MOD, BPF_MUL, BPF_RSH = 0x04, 0x90, 0x20, 0x70
_KNUTH = 2654435761  # multiplicative hash constant (golden ratio, 32-bit)
BPF_MAXINSNS = 4096
HASH_FALLBACK = 0xFFFFFFFF
_U32 = 0xFFFFFFFF

Insn = tuple[int, int, int, int]


class ProgramTooLarge(ValueError):
    """The CPU table needs more than BPF_MAXINSNS instructions (about 2046 CPUs)."""


def build_cpu_table_program(cpu_to_slot: Mapping[int, int]) -> list[Insn]:
    """The FACTS §7.4 table program as (code, jt, jf, k) tuples.

    ``ld [SKF_AD_OFF+SKF_AD_CPU]``; per CPU ``jeq #cpu, 0, 1`` + ``ret #slot``;
    last ``ret #0xFFFFFFFF`` (no entry → kernel hash).  ``slot`` is a reuseport
    group position.  CPUs are emitted in ascending order (deterministic);
    sparse ids are fine.
    """
    n = 2 * len(cpu_to_slot) + 2
    if n > BPF_MAXINSNS:
        raise ProgramTooLarge(
            f"CPU table for {len(cpu_to_slot)} CPUs needs {n} instructions, more than BPF_MAXINSNS "
            f"({BPF_MAXINSNS}); at most {(BPF_MAXINSNS - 2) // 2} CPUs fit: leave some CPUs to the hash"
        )
    prog: list[Insn] = [(BPF_LD | BPF_W | BPF_ABS, 0, 0, (SKF_AD_OFF + SKF_AD_CPU) & _U32)]
    for cpu in sorted(cpu_to_slot):
        slot = cpu_to_slot[cpu]
        if cpu < 0 or slot < 0:
            raise ValueError(f"CPU table entry {cpu} -> {slot}: CPU and slot must be >= 0")
        prog.append((BPF_JMP | BPF_JEQ | BPF_K, 0, 1, cpu & _U32))
        prog.append((BPF_RET | BPF_K, 0, 0, slot & _U32))
    prog.append((BPF_RET | BPF_K, 0, 0, HASH_FALLBACK))
    return prog


def _load_source_port(ipv6: bool) -> list[Insn]:
    """A = the client's TCP source port (read relative to the network header)."""
    if ipv6:
        return [(BPF_LD | BPF_H | BPF_ABS, 0, 0, (SKF_NET_OFF + 40) & _U32)]
    return [(BPF_LDX | BPF_B | BPF_MSH, 0, 0, SKF_NET_OFF & _U32),
            (BPF_LD | BPF_H | BPF_IND, 0, 0, SKF_NET_OFF & _U32)]


def build_selection_program(
    *,
    healthy: Sequence[int],
    group_size: int,
    cpu_to_pos: Mapping[int, int] | None = None,
    ipv6: bool = False,
    probes: Mapping[int, int] | None = None,
) -> list[Insn] | None:
    """The program for a slot set where some slots must not get new connections.

    ``healthy``: group positions that may take new connections (ready, not
    drained).  ``cpu_to_pos``: optional NUMA table (CPU → position) tried
    first.  Connections the table does not place are spread over the healthy
    positions by a multiplicative hash of the client's source port (the
    kernel's own hash would include unhealthy sockets).  ``probes``: source
    port → position, checked before anything else: the supervisor's own probe
    connections reach the one slot they test, whatever its health.  Returns
    None when plain kernel hashing is right: no probes, and every slot healthy
    with no NUMA table, or no slot healthy at all (then queues must keep
    filling for the replacements).

    The source port is read relative to the network header (``SKF_NET_OFF``):
    IPv4 via ``ldx 4*([0]&0xf)`` (honours IP options), IPv6 at offset 40.
    """
    pos = sorted(set(healthy))
    if any(p < 0 or p >= group_size for p in pos):
        raise ValueError(f"healthy positions {pos} outside a group of {group_size}")
    probe_map = dict(probes or {})
    if any(not 0 <= p < group_size for p in probe_map.values()) or any(not 0 < sp < 65536 for sp in probe_map):
        raise ValueError(f"probe entries {probe_map} outside a group of {group_size} or not ports")
    table = dict(cpu_to_pos or {})
    everyone = len(pos) == group_size
    prog: list[Insn] = []
    if probe_map:
        prog += _load_source_port(ipv6)
        for sport, p in sorted(probe_map.items()):
            prog.append((BPF_JMP | BPF_JEQ | BPF_K, 0, 1, sport))
            prog.append((BPF_RET | BPF_K, 0, 0, p))
    elif not pos or (everyone and not table):
        return None
    if not pos or (everyone and not table):
        prog.append((BPF_RET | BPF_K, 0, 0, HASH_FALLBACK))
        return prog
    if table:
        prog += build_cpu_table_program(table)[:-1]  # drop the final "ret hash": fall into the spread below
        if everyone:
            prog.append((BPF_RET | BPF_K, 0, 0, HASH_FALLBACK))
            return prog
    prog += _load_source_port(ipv6)
    # Linux clients prefer *even* ephemeral ports for connect(): mix before the
    # modulo or a 2-way split sends nearly everything to one side.
    prog.append((BPF_ALU | BPF_MUL | BPF_K, 0, 0, _KNUTH))
    prog.append((BPF_ALU | BPF_RSH | BPF_K, 0, 0, 16))
    prog.append((BPF_ALU | BPF_MOD | BPF_K, 0, 0, len(pos)))
    for i, p in enumerate(pos):
        prog.append((BPF_JMP | BPF_JEQ | BPF_K, 0, 1, i))
        prog.append((BPF_RET | BPF_K, 0, 0, p))
    prog.append((BPF_RET | BPF_K, 0, 0, HASH_FALLBACK))
    if len(prog) > BPF_MAXINSNS:
        raise ProgramTooLarge(f"selection program needs {len(prog)} instructions > {BPF_MAXINSNS}")
    return prog


def numa_cpu_to_slot(
    cpu_node: Mapping[int, int],
    node_slots: Mapping[int, Sequence[int]],
    group_index: Mapping[int, int],
) -> dict[int, int]:
    """CPU → reuseport group position of a healthy slot on the CPU's node.

    ``cpu_node``: CPU → node (``Topology.cpu_node()``).  ``node_slots``: node →
    its healthy slots (in the order to spread over).  ``group_index``: slot →
    its socket's current position in the group.  A node's CPUs (ascending)
    go round-robin over its slots that have a group position; CPUs of a node
    with none are left out, so their connections fall back to the hash.
    """
    out: dict[int, int] = {}
    by_node: dict[int, list[int]] = {}
    for cpu, node in cpu_node.items():
        by_node.setdefault(node, []).append(cpu)
    for node, cpus in by_node.items():
        seen: set[int] = set()
        slots = []
        for s in node_slots.get(node, ()):
            if s in group_index and s not in seen:
                seen.add(s)
                slots.append(s)
        if not slots:
            continue
        for i, cpu in enumerate(sorted(cpus)):
            out[cpu] = group_index[slots[i % len(slots)]]
    return out


def hot_set(
    healthy: Sequence[int],
    slot_node: Mapping[int, int],
    node_size: Mapping[int, int],
    *,
    keep: Collection[int] = (),
    avoid: Collection[int] = (),
    slot_cpus: Mapping[int, Sequence[int]] | None = None,
) -> tuple[int, ...]:
    """The healthy slots that take new connections: per node at most ``node_size[node]``.

    A node with no entry in ``node_size``, or with no more healthy slots than
    its size, keeps all of them.  Otherwise the slots are ranked: not in
    ``avoid`` (a worker that just stalled or shed) before the rest, in
    ``keep`` (the current hot set: its connections are already there) before
    the rest, then by slot number; and taken in rank order, except that a
    slot whose CPUs (``slot_cpus``) the slots taken so far already cover
    waits while one that brings a CPU of its own is left (two hot workers
    bound to one CPU would leave the other idle).  Every node keeps at least
    one slot, so the per-node (NUMA) guarantee of the table is never lost.
    """
    by_node: dict[int, list[int]] = {}
    for s in sorted(set(healthy)):
        by_node.setdefault(slot_node.get(s, -1), []).append(s)
    keep_set, avoid_set = set(keep), set(avoid)
    out: list[int] = []
    for node, slots in by_node.items():
        size = node_size.get(node)
        if size is None or len(slots) <= size:
            out += slots
            continue
        ranked = sorted(slots, key=lambda s: (s in avoid_set, s not in keep_set, s))
        size = max(1, size)
        if not slot_cpus:
            out += ranked[:size]
            continue
        taken: list[int] = []
        covered: set[int] = set()
        later: list[int] = []
        for s in ranked:
            if len(taken) == size:
                break
            cpus = set(slot_cpus.get(s, ()))
            if cpus and cpus <= covered:
                later.append(s)
                continue
            taken.append(s)
            covered |= cpus
        out += taken + later[:size - len(taken)]
    return tuple(sorted(out))


def group_positions_after_close(order: Sequence[int], closed: int) -> list[int]:
    """Group order after the socket of slot ``closed`` leaves: the last moves into its hole.

    ``order[i]`` is the slot at group position i (listen() order).  Returns the
    new order; ``{s: i for i, s in enumerate(result)}`` is the next ``group_index``.
    """
    new = list(order)
    i = new.index(closed)
    last = new.pop()
    if i < len(new):
        new[i] = last
    return new


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _as_socket(sock: Any) -> tuple[socket.socket, bool]:
    if isinstance(sock, socket.socket):
        return sock, False
    fd = sock if isinstance(sock, int) else sock.fileno()
    return socket.socket(fileno=fd), True


def attach_reuseport_cbpf(sock: socket.socket | int, program: Sequence[Insn]) -> None:
    """Attach ``program`` to the reuseport group of ``sock`` (replaces any program).

    Attaching through any member sets the program for the whole group.  No
    privilege needed.  The filter array stays referenced until setsockopt
    returns (the kernel copies it during the call).
    """
    if not program:
        raise ValueError("empty BPF program")
    if len(program) > BPF_MAXINSNS:
        raise ProgramTooLarge(f"{len(program)} instructions > BPF_MAXINSNS ({BPF_MAXINSNS})")
    arr = (_SockFilter * len(program))(*[_SockFilter(c, jt, jf, k & _U32) for c, jt, jf, k in program])
    fprog = _SockFprog(len(program), ctypes.cast(arr, ctypes.POINTER(_SockFilter)))
    s, borrowed = _as_socket(sock)
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, bytes(fprog))
    finally:
        if borrowed:
            s.detach()
    del arr  # alive until here, after the kernel copied it


def detach_reuseport_bpf(sock: socket.socket | int) -> bool:
    """Detach the group's program: back to hashing.  False when none was attached."""
    s, borrowed = _as_socket(sock)
    try:
        s.setsockopt(socket.SOL_SOCKET, SO_DETACH_REUSEPORT_BPF, 0)
    except OSError as e:
        if e.errno == errno.ENOENT:
            return False
        raise
    finally:
        if borrowed:
            s.detach()
    return True


@dataclass(frozen=True)
class CollapseVerdict:
    """``collapsed``: one slot took at least ``share`` of the accepts while others
    were expected to get traffic; ``dominant`` is that slot."""

    collapsed: bool
    dominant: int | None
    share: float
    total: int
    reason: str


def loopback_collapse_check(
    accepts: Mapping[int, int],
    *,
    expected_slots: Sequence[int] | None = None,
    min_total: int = 200,
    max_share: float = 0.95,
) -> CollapseVerdict:
    """Did steering collapse onto one slot (nginx#150)?

    The supervisor counts accepts per slot (from worker stats) over a window
    with the program attached.  When one CPU runs every RX softirq (loopback
    clients, a single-queue NIC, IRQs all on one CPU) the table maps all
    traffic to that CPU's node and slot.  Verdict only once ``min_total``
    accepts were seen and at least two slots were expected; then "collapsed"
    when one slot has ``max_share`` or more.  On a collapse the supervisor
    should detach the program (hash fallback), log the reason, and re-check
    after IRQ steering changes.
    """
    slots = list(expected_slots) if expected_slots is not None else list(accepts)
    total = sum(max(0, int(accepts.get(s, 0))) for s in slots)
    if len(slots) < 2:
        return CollapseVerdict(False, None, 1.0 if total else 0.0, total, "fewer than two slots: nothing to spread")
    if total < min_total:
        return CollapseVerdict(False, None, 0.0, total, f"only {total} accepts (< {min_total}): no verdict yet")
    dom = max(slots, key=lambda s: accepts.get(s, 0))
    share = accepts.get(dom, 0) / total
    if share >= max_share:
        return CollapseVerdict(True, dom, share, total,
                               f"slot {dom} took {share:.0%} of {total} accepts across {len(slots)} slots: "
                               f"one CPU runs the RX softirq for everything (loopback or single-queue NIC); "
                               f"detach the CBPF program and let the kernel hash")
    return CollapseVerdict(False, dom, share, total, f"busiest slot {dom} has {share:.0%} of {total} accepts")
