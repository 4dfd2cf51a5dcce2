"""How local a running worker really is: its pages per node and where its threads ran.

Why besides the binding check (``verify``): a binding says where pages and
threads *may* go; what an operator needs to watch (and alert on) is where
they *are*.  Pages move after binding (``migratepages``, NUMA balancing, a
policy the app changed, a cpuset change), and a thread can be moved by a
``taskset`` from outside.  One sample is:

* the worker's anonymous memory per node (heap, stack, anonymous mappings:
  what it allocated itself), from ``/proc/PID/numa_maps``
  (``verify.read_node_pages``: the same parse as the binding check).  File
  pages (the interpreter, shared libraries, page cache) are left out: they
  are shared and sit on whichever node first read them, so a worker bound
  to node 1 maps node-0 copies of libpython without anything being wrong
  (in the lab VM that alone put an exec'd worker at 83 % "local");
* for each thread, the CPU it last ran on (``/proc/PID/task/TID/stat``
  field 39, ``processor``), counted as off node when that CPU is not one of
  the node's.

Reading ``numa_maps`` makes the kernel walk the page tables of every VMA, so
its cost grows with RSS; ``LocalitySample.cost_s`` is the CPU time one sample
took (this thread's, kernel time included), which the caller uses to space
samples within a CPU budget.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field
from typing import Iterable

from numaserve.bind.verify import read_node_pages

__all__ = ["LocalitySample", "parse_stat_processor", "read_thread_cpus", "sample_locality"]

_GONE = (errno.ENOENT, errno.ESRCH)


@dataclass(frozen=True)
class LocalitySample:
    """One look at a worker: its anonymous bytes per node and its threads' last CPUs."""

    pid: int
    nodes: tuple[int, ...]                 # the worker's own node(s)
    bytes_per_node: dict[int, int] = field(default_factory=dict)
    threads: int = 0
    threads_off_node: int = 0
    cost_s: float = 0.0                    # CPU time the sample took (thread time, kernel included)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_node.values())

    @property
    def local_bytes(self) -> int:
        return sum(b for n, b in self.bytes_per_node.items() if n in self.nodes)

    @property
    def remote_bytes(self) -> int:
        return self.total_bytes - self.local_bytes

    @property
    def local_ratio(self) -> float | None:
        """Share of its anonymous bytes on the worker's own node(s); None when there are none
        (or numa_maps could not be read)."""
        total = self.total_bytes
        return self.local_bytes / total if total else None

    def remote_nodes(self) -> tuple[int, ...]:
        """Nodes other than its own holding some of its pages (where a repair moves them from)."""
        return tuple(sorted(n for n, b in self.bytes_per_node.items() if b and n not in self.nodes))


def parse_stat_processor(text: str) -> int | None:
    """Field 39 (``processor``: the CPU the task last ran on) of a ``/proc/.../stat`` line.

    The command name (field 2) may contain spaces and parentheses, so fields
    are counted after its last ``)``.  None when the line is cut short.
    """
    _, sep, rest = text.rpartition(")")
    if not sep:
        return None
    fields = rest.split()
    # rest starts at field 3 (state): field 39 is index 36
    if len(fields) < 37 or not fields[36].lstrip("-").isdigit():
        return None
    return int(fields[36])


def _read_small(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096).decode("utf-8", "replace")
    finally:
        os.close(fd)


def read_thread_cpus(pid: int, proc_root: str = "/proc") -> dict[int, int]:
    """Thread id → the CPU it last ran on; threads that exit while we read are left out.

    Raises ProcessLookupError when the process itself is gone.
    """
    tdir = os.path.join(proc_root, str(pid), "task")
    try:
        tids = [t for t in os.listdir(tdir) if t.isdigit()]
    except FileNotFoundError:
        raise ProcessLookupError(errno.ESRCH, f"process {pid} is gone") from None
    out: dict[int, int] = {}
    for t in tids:
        try:
            cpu = parse_stat_processor(_read_small(os.path.join(tdir, t, "stat")))
        except OSError as e:
            if e.errno in _GONE:
                continue
            raise
        if cpu is not None:
            out[int(t)] = cpu
    return out


def sample_locality(pid: int, nodes: Iterable[int], node_cpus: Iterable[int],
                    proc_root: str = "/proc") -> LocalitySample:
    """One sample of ``pid`` against its own ``nodes`` and their CPUs ``node_cpus``.

    ``node_cpus`` empty (topology unknown) → no thread is counted off node.
    Raises ProcessLookupError when the process is gone.
    """
    t0 = time.thread_time()
    own = tuple(sorted(set(nodes)))
    cpus = frozenset(node_cpus)
    last = read_thread_cpus(pid, proc_root)
    _, nbytes = read_node_pages(pid, proc_root, anon_only=True)
    off = sum(1 for c in last.values() if cpus and c not in cpus)
    return LocalitySample(pid, own, nbytes, len(last), off, time.thread_time() - t0)
