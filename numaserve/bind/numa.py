"""Bind and read back CPU affinity and memory policy of the calling thread.

Raw ``set_mempolicy``/``get_mempolicy`` through ``ctypes`` + ``syscall(2)``: no
libnuma, no PyPI package.  Both calls act on the *calling thread* only; threads
and processes created afterwards inherit the policy (also across ``execve``),
which is why numaserve binds in a single-threaded trampoline before the worker
image starts (see ``numaserve/bind/launch.py``).

This module is **stdlib-only and imports nothing from numaserve** on purpose:
``launch.py`` loads it by file path under ``python -I -S`` so there is one
implementation of the syscall logic.  It also avoids ``dataclasses``/``typing``
imports (~20 ms at interpreter start) to keep the trampoline fast.
"""

from __future__ import annotations

import ctypes
import errno
import os

TYPE_CHECKING = False
if TYPE_CHECKING:  # no typing import at run time (launcher start-up budget)
    from typing import Iterable

__all__ = [
    "MemPolicy",
    "MODES",
    "MPOL_F_STATIC_NODES",
    "MPOL_F_RELATIVE_NODES",
    "MPOL_F_NUMA_BALANCING",
    "MPOL_MODE_FLAGS",
    "UnsupportedArchitecture",
    "syscall_numbers",
    "nr_node_ids",
    "nodemask_bits",
    "decode_mode",
    "parse_numa_maps_token",
    "set_mempolicy",
    "get_mempolicy",
    "set_cpu_affinity",
    "get_cpu_affinity",
    "libnuma_available",
    "migrate_pages",
    "load_libc",
    "parse_list",
    "format_list",
]

# <linux/mempolicy.h>
MODES: dict[str, int] = {
    "default": 0,
    "preferred": 1,
    "bind": 2,
    "interleave": 3,
    "local": 4,
    "preferred_many": 5,
    "weighted_interleave": 6,
}
_MODE_NAMES = {v: k for k, v in MODES.items()}
MPOL_F_STATIC_NODES = 1 << 15
MPOL_F_RELATIVE_NODES = 1 << 14
MPOL_F_NUMA_BALANCING = 1 << 13
MPOL_MODE_FLAGS = MPOL_F_STATIC_NODES | MPOL_F_RELATIVE_NODES | MPOL_F_NUMA_BALANCING

# numa_maps spelling of each mode (kernel mm/mempolicy.c policy_modes[]).
_TOKEN_OF_MODE = {
    "default": "default",
    "preferred": "prefer",
    "bind": "bind",
    "interleave": "interleave",
    "local": "local",
    "preferred_many": "prefer (many)",
    "weighted_interleave": "weighted interleave",
}
_MODE_OF_TOKEN = {v: k for k, v in _TOKEN_OF_MODE.items()}
# Modes that take a node mask; the others are set with NULL / maxnode 0.
_MASK_MODES = frozenset({"preferred", "bind", "interleave", "preferred_many", "weighted_interleave"})

# Syscall numbers: <asm/unistd_64.h> (x86_64) and the generic table (aarch64).
_SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {"mbind": 237, "set_mempolicy": 238, "get_mempolicy": 239, "migrate_pages": 256},
    "aarch64": {"mbind": 235, "set_mempolicy": 237, "get_mempolicy": 236, "migrate_pages": 238},
}
_MAX_NODE = 1 << 15  # kernel refuses maxnode > PAGE_SIZE*8; anything near is a typo
_ULONG_BITS = ctypes.sizeof(ctypes.c_ulong) * 8
_SYSFS_NODE = "/sys/devices/system/node"


class UnsupportedArchitecture(OSError):
    """No known syscall numbers for this CPU architecture (we never guess)."""


class MemPolicy:
    """A memory policy as the kernel reports it (value type, hashable).

    ``mode`` is one of ``MODES`` ("preferred", not "prefer"); ``nodes`` sorted
    node ids; ``static``/``relative`` are MPOL_F_STATIC_NODES /
    MPOL_F_RELATIVE_NODES; ``balancing`` is MPOL_F_NUMA_BALANCING.
    (Not a @dataclass: importing dataclasses costs ~17 ms in the launcher.)
    """

    __slots__ = ("mode", "nodes", "static", "relative", "balancing")

    def __init__(
        self,
        mode: str,
        nodes: Iterable[int] = (),
        static: bool = False,
        relative: bool = False,
        balancing: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown memory policy mode {mode!r} (known: {', '.join(MODES)})")
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "nodes", tuple(sorted({int(n) for n in nodes})))
        object.__setattr__(self, "static", bool(static))
        object.__setattr__(self, "relative", bool(relative))
        object.__setattr__(self, "balancing", bool(balancing))

    mode: str
    nodes: tuple[int, ...]
    static: bool
    relative: bool
    balancing: bool

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("MemPolicy is immutable")

    def key(self) -> tuple[object, ...]:
        """Every field, for equality and hashing."""
        return (self.mode, self.nodes, self.static, self.relative, self.balancing)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MemPolicy) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())

    def __repr__(self) -> str:
        return (
            f"MemPolicy(mode={self.mode!r}, nodes={self.nodes!r}, static={self.static!r}, "
            f"relative={self.relative!r}, balancing={self.balancing!r})"
        )

    def token(self) -> str:
        """The ``/proc/PID/numa_maps`` spelling: ``bind=static:1``, ``prefer:0``, ``local``...

        Mirrors the kernel's ``mpol_to_str()``: mode word, ``=static``/``=relative``
        (and ``balancing``) when a mode flag is set, ``:nodelist`` when non-empty.
        """
        out = _TOKEN_OF_MODE[self.mode]
        flags = []
        if self.static:
            flags.append("static")
        elif self.relative:
            flags.append("relative")
        if self.balancing:
            flags.append("balancing")
        if flags:
            out += "=" + "|".join(flags)
        if self.nodes and self.mode not in ("default", "local"):
            out += ":" + format_list(self.nodes)
        return out


def parse_numa_maps_token(token: str) -> MemPolicy:
    """Parse a numa_maps policy column (``bind=static:0-1``) into a MemPolicy.

    ``prefer (many)`` and ``weighted interleave`` contain a space in the kernel's
    spelling; pass the whole token.  Raises ValueError on anything else.
    """
    text = token.strip()
    head, sep, nodelist = text.partition(":")
    word, _, flagtext = head.partition("=")
    mode = _MODE_OF_TOKEN.get(word.strip())
    if mode is None:
        raise ValueError(f"unknown numa_maps policy token {token!r}")
    flags = [f for f in flagtext.split("|") if f] if flagtext else []
    unknown = [f for f in flags if f not in ("static", "relative", "balancing")]
    if unknown:
        raise ValueError(f"unknown policy flag {unknown[0]!r} in numa_maps token {token!r}")
    try:
        nodes = parse_list(nodelist) if sep else ()
    except ValueError:
        raise ValueError(f"bad node list in numa_maps token {token!r}") from None
    return MemPolicy(mode, nodes, "static" in flags, "relative" in flags, "balancing" in flags)


def syscall_numbers(machine: str | None = None) -> dict[str, int]:
    """Syscall numbers for ``machine`` (default: this one, ``uname -m``)."""
    m = os.uname().machine if machine is None else machine
    try:
        return dict(_SYSCALLS[m])
    except KeyError:
        raise UnsupportedArchitecture(
            errno.ENOSYS,
            f"memory policy syscalls: unsupported architecture {m!r} "
            f"(known: {', '.join(sorted(_SYSCALLS))}); refusing to guess syscall numbers",
        ) from None


def nr_node_ids(sysfs_node_dir: str = _SYSFS_NODE) -> int:
    """Highest possible node id + 1, from ``node/possible`` (1 when sysfs lacks it)."""
    try:
        with open(os.path.join(sysfs_node_dir, "possible")) as f:
            ids = parse_list(f.read())
    except (OSError, ValueError):
        return 1
    return (max(ids) + 1) if ids else 1


def nodemask_bits(nodes: Iterable[int] = (), nr_nodes: int | None = None) -> int:
    """Bit count of the nodemask to pass as ``maxnode`` (the robust off-by-one rule).

    The kernel reads ``maxnode - 1`` bits and ``get_mempolicy`` wants at least
    ``nr_node_ids``; so: ``max(nr_node_ids, max(node)+1) + 64``, rounded up to
    whole ``unsigned long`` words, and we pass that whole bit count.
    """
    n = nr_node_ids() if nr_nodes is None else nr_nodes
    top = max([n] + [int(x) + 1 for x in nodes])
    need = top + 64
    return -(-need // _ULONG_BITS) * _ULONG_BITS


def decode_mode(raw: int) -> tuple[str, bool, bool, bool]:
    """Split ``get_mempolicy``'s mode (flags ORed in, BIND|STATIC = 32770) into
    (mode name, static, relative, balancing)."""
    base = raw & ~MPOL_MODE_FLAGS
    name = _MODE_NAMES.get(base)
    if name is None:
        raise ValueError(f"unknown memory policy mode number {base} (raw {raw})")
    return (
        name,
        bool(raw & MPOL_F_STATIC_NODES),
        bool(raw & MPOL_F_RELATIVE_NODES),
        bool(raw & MPOL_F_NUMA_BALANCING),
    )


def set_mempolicy(mode: str, nodes: Iterable[int] = (), *, static: bool = True) -> None:
    """Set the calling thread's memory policy (inherited by later threads, fork, exec).

    bind/preferred/interleave use MPOL_F_STATIC_NODES unless ``static=False``
    (physical node ids that a later cpuset change never remaps); default/local
    take no nodes.  Bad input → ValueError before the syscall; a kernel refusal
    → OSError whose message names the mode, the nodes and why.
    """
    if mode not in MODES:
        raise ValueError(f"unknown memory policy {mode!r} (use one of: {', '.join(MODES)})")
    node_list = sorted({_check_node(n) for n in nodes})
    if mode in _MASK_MODES:
        if not node_list:
            raise ValueError(f"set_mempolicy({mode}): needs at least one node")
    elif node_list:
        raise ValueError(f"set_mempolicy({mode}): takes no nodes (got {format_list(node_list)})")
    nrs = syscall_numbers()
    raw_mode = MODES[mode]
    if mode in _MASK_MODES:
        if static:
            raw_mode |= MPOL_F_STATIC_NODES
        bits = nodemask_bits(node_list)
        mask = _make_mask(node_list, bits)
        maxnode = bits
    else:
        mask, maxnode = None, 0
    libc = load_libc()
    rc = libc.syscall(
        ctypes.c_long(nrs["set_mempolicy"]), ctypes.c_int(raw_mode), mask, ctypes.c_ulong(maxnode)
    )
    if rc != 0:
        err = ctypes.get_errno()
        what = f"set_mempolicy({mode}" + (f", nodes={format_list(node_list)})" if node_list else ")")
        reason = os.strerror(err)
        hint = _einval_hint(node_list) if err == errno.EINVAL else ""
        raise OSError(err, f"{what}: {reason}" + (f" — {hint}" if hint else ""))


def get_mempolicy() -> MemPolicy:
    """The calling thread's memory policy (mode flags masked off into booleans)."""
    nrs = syscall_numbers()
    bits = nodemask_bits()
    mask = _make_mask((), bits)
    mode = ctypes.c_int(0)
    libc = load_libc()
    rc = libc.syscall(
        ctypes.c_long(nrs["get_mempolicy"]),
        ctypes.byref(mode),
        mask,
        ctypes.c_ulong(bits),
        None,
        ctypes.c_ulong(0),
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"get_mempolicy: {os.strerror(err)}")
    name, static, relative, balancing = decode_mode(mode.value)
    nodes = _mask_nodes(mask)
    if name == "preferred" and not nodes:
        name = "local"  # pre-5.x kernels report MPOL_LOCAL as PREFERRED with an empty mask
    if name in ("default", "local"):
        nodes = ()
    return MemPolicy(name, nodes, static, relative, balancing)


def set_cpu_affinity(cpus: Iterable[int]) -> None:
    """Pin the calling thread (threads created later inherit it) to ``cpus``."""
    cpu_set = {int(c) for c in cpus}
    if not cpu_set:
        raise ValueError("set_cpu_affinity: empty CPU list")
    if min(cpu_set) < 0:
        raise ValueError(f"set_cpu_affinity: negative CPU id {min(cpu_set)}")
    try:
        os.sched_setaffinity(0, cpu_set)
    except OSError as e:
        hint = ""
        if e.errno == errno.EINVAL:
            hint = " — none of these CPUs is online and allowed (cpuset)"
        raise OSError(
            e.errno, f"sched_setaffinity(cpus={format_list(cpu_set)}): {os.strerror(e.errno or 0)}{hint}"
        ) from None


def get_cpu_affinity() -> tuple[int, ...]:
    """The calling thread's CPU affinity, sorted."""
    return tuple(sorted(os.sched_getaffinity(0)))


def migrate_pages(pid: int, from_nodes: Iterable[int], to_nodes: Iterable[int]) -> int:
    """Move process ``pid``'s pages on ``from_nodes`` to ``to_nodes`` (``migrate_pages(2)``).

    Whole process, every VMA: how a worker whose pages drifted to another node
    is repaired without a restart.  Its own memory policy keeps new pages
    where they belong; this moves the old ones back.  Returns the number of
    pages the kernel could not move (shared pages of another process stay
    put without CAP_SYS_NICE).  Bad input → ValueError; a kernel refusal →
    OSError naming the pid, the nodes and why.
    """
    old = sorted({_check_node(n) for n in from_nodes})
    new = sorted({_check_node(n) for n in to_nodes})
    if not old or not new:
        raise ValueError("migrate_pages: needs at least one node to move from and one to move to")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise ValueError(f"migrate_pages: bad pid {pid!r}")
    nrs = syscall_numbers()
    bits = nodemask_bits(old + new)
    libc = load_libc()
    rc = libc.syscall(
        ctypes.c_long(nrs["migrate_pages"]), ctypes.c_int(pid), ctypes.c_ulong(bits),
        _make_mask(old, bits), _make_mask(new, bits),
    )
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"migrate_pages(pid {pid}, nodes {format_list(old)} -> {format_list(new)}): "
                           f"{os.strerror(err)}")
    return int(rc)


def libnuma_available() -> bool:
    """True when ``libnuma.so.1`` loads and ``numa_available() >= 0`` (cross-check only)."""
    try:
        lib = ctypes.CDLL("libnuma.so.1")
        return int(lib.numa_available()) >= 0
    except (OSError, AttributeError):
        return False


# ----------------------------------------------------------------- internals

_LIBC: ctypes.CDLL | None = None


def load_libc() -> ctypes.CDLL:
    """libc with errno, loaded once (public: the launch trampoline, loaded by file path, calls
    prctl through it)."""
    global _LIBC
    if _LIBC is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.syscall.restype = ctypes.c_long
        _LIBC = lib
    return _LIBC


def _check_node(n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        try:
            n = int(str(n))
        except ValueError:
            raise ValueError(f"bad node id {n!r}") from None
    if n < 0:
        raise ValueError(f"bad node id {n}: must be >= 0")
    if n >= _MAX_NODE:
        raise ValueError(f"bad node id {n}: larger than any kernel supports")
    return n


def _make_mask(nodes: Iterable[int], bits: int) -> ctypes.Array[ctypes.c_ulong]:
    words = (ctypes.c_ulong * (bits // _ULONG_BITS))()
    for n in nodes:
        words[n // _ULONG_BITS] |= 1 << (n % _ULONG_BITS)
    return words


def _mask_nodes(mask: ctypes.Array[ctypes.c_ulong]) -> tuple[int, ...]:
    out = []
    for i, w in enumerate(mask):
        for b in range(_ULONG_BITS):
            if w >> b & 1:
                out.append(i * _ULONG_BITS + b)
    return tuple(out)


def _read_list(path: str) -> tuple[int, ...] | None:
    try:
        with open(path) as f:
            return parse_list(f.read())
    except (OSError, ValueError):
        return None


def _einval_hint(nodes: list[int]) -> str:
    """Why EINVAL, in operator terms: which requested nodes are not usable."""
    with_mem = _read_list(os.path.join(_SYSFS_NODE, "has_memory"))
    if with_mem is None:
        with_mem = _read_list(os.path.join(_SYSFS_NODE, "online"))
    allowed: tuple[int, ...] | None = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Mems_allowed_list:"):
                    allowed = parse_list(line.split(":", 1)[1])
    except (OSError, ValueError):
        pass
    usable = set(with_mem or ()) & set(allowed if allowed is not None else (with_mem or ()))
    bad = [n for n in nodes if n not in usable]
    if not bad or with_mem is None:
        return "a node is not online, has no memory, or is not allowed by the cpuset"
    word = "node" if len(bad) == 1 else "nodes"
    verb = "is" if len(bad) == 1 else "are"
    return (
        f"{word} {format_list(bad)} {verb} not online/allowed "
        f"(nodes with memory: {format_list(with_mem) or 'none'}; "
        f"allowed: {format_list(allowed) if allowed is not None else 'unknown'})"
    )


# Minimal cpulist helpers (numaserve.cpulist is the full parser; this module
# must not import the package, see the module docstring).
def parse_list(text: str) -> tuple[int, ...]:
    """"0-3,8" -> (0, 1, 2, 3, 8); ValueError on bad syntax (the trampoline parses its flags)."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            if text.strip():
                raise ValueError(f"bad list {text.strip()!r}")
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad list element {part!r}")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"descending range {part!r}")
        out.update(range(a, b + 1))
    return tuple(sorted(out))


def format_list(items: Iterable[int]) -> str:
    """(0, 1, 2, 3, 8) -> "0-3,8" (the trampoline's flags and this module's messages)."""
    vals = sorted({int(i) for i in items})
    parts: list[str] = []
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        parts.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ",".join(parts)
