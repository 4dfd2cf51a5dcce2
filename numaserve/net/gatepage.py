"""A worker's gate state in a small shared page the supervisor reads (``numaserve.supervisor.doorshed``).

Why: the supervisor can answer a stalled or overloaded worker's accept queue
with 503 without that worker's GIL, but only if it knows what the worker's
gate would admit and whether its loop is stalled; asking the worker over the
control channel needs the very loop that is stuck.  So the loop's probe
(``LoopProbe``) stamps this page at every firing and the supervisor reads it
whenever it likes.  One writer (the slot's worker), any number of readers; a
sequence number (odd while a stamp is being written) makes a torn read
detectable.  The file lives in the runtime directory, one per slot, created
by the supervisor before any worker starts.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import NamedTuple

__all__ = ["GatePage", "GateView", "PAGE_BYTES", "create_page"]

PAGE_BYTES = 128
#: seq, pid, tid, flags, beat, period, thread_cpu, inflight, waiting, request_cpu_s, stall_limit, last_shed
_LAYOUT = struct.Struct("<IiiIdddiiddd")
_SEQ = struct.Struct("<I")
_OVERLOADED = 1


class GateView(NamedTuple):
    """One stamp: what the supervisor's decision (``numaserve.loops.door``) reads."""

    pid: int               # the writing worker
    tid: int               # its loop's thread (for /proc/<pid>/task/<tid>/schedstat)
    beat: float            # CLOCK_MONOTONIC of the probe firing (system-wide, same in every process)
    period: float          # the probe's next period: the loop is stalled past beat + period
    thread_cpu: float      # the loop thread's CPU time at ``beat`` (CLOCK_THREAD_CPUTIME_ID, s)
    inflight: int
    waiting: int           # CpuGate.waiting: requests waiting for CPU at its last decision, less those done since
    request_cpu_s: float   # the gate's learnt CPU per request
    stall_limit: float     # CpuGate.stall_limit at ``beat``
    last_shed: float       # the gate's last 503 (monotonic; -inf: never)
    overloaded: bool       # CpuGate.overloaded (sustained, not a burst)


def create_page(path: str) -> None:
    """A zeroed page file (mode 0600: only the supervisor's uid reads or writes it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, PAGE_BYTES)
    finally:
        os.close(fd)


class GatePage:
    """The mapped page; ``stamp`` on the worker's loop, ``read`` anywhere."""

    __slots__ = ("_map", "_seq", "path")

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size < PAGE_BYTES:
                raise OSError(f"{path}: gate page shorter than {PAGE_BYTES} bytes")
            self._map = mmap.mmap(fd, PAGE_BYTES)
        finally:
            os.close(fd)
        self.path = path
        self._seq = _SEQ.unpack_from(self._map, 0)[0] & ~1

    def stamp(self, pid: int, tid: int, beat: float, period: float, thread_cpu: float, inflight: int, waiting: int,
              request_cpu_s: float, stall_limit: float, last_shed: float, overloaded: bool) -> None:
        """Write one stamp (a few microseconds: three packs into the map)."""
        m = self._map
        seq = self._seq + 1
        _SEQ.pack_into(m, 0, seq & 0xFFFFFFFF)            # odd: being written
        _LAYOUT.pack_into(m, 0, seq & 0xFFFFFFFF, pid, tid, _OVERLOADED if overloaded else 0,
                          beat, period, thread_cpu, inflight, waiting, request_cpu_s, stall_limit,
                          max(last_shed, -1e300))
        seq = (seq + 1) & 0xFFFFFFFF
        _SEQ.pack_into(m, 0, seq)                         # even again: complete
        self._seq = seq

    def read(self) -> GateView | None:
        """The last complete stamp; None if none was written yet or the writer kept racing us."""
        m = self._map
        for _ in range(4):
            a = _SEQ.unpack_from(m, 0)[0]
            if a & 1:
                continue
            vals = _LAYOUT.unpack_from(m, 0)
            if vals[0] != a or _SEQ.unpack_from(m, 0)[0] != a:
                continue
            if a == 0 or vals[1] <= 0:
                return None
            _, pid, tid, flags, beat, period, tcpu, inflight, waiting, cpu, limit, shed = vals
            return GateView(pid, tid, beat, period, tcpu, inflight, waiting, cpu, limit, shed, bool(flags & _OVERLOADED))
        return None

    def close(self) -> None:
        self._map.close()
