"""The supervisor's file descriptors: the limit, a budget per listener, and what holds them.

Why the supervisor must never reach its open-file limit (libzmq 4.3.5,
read in its source):

* ``ipc_listener.cpp``: ``accept()`` failing with EMFILE is not among the
  errors it tolerates (``errno_assert`` allows ENFILE, not EMFILE), so the
  next ipc connection -- a worker's control channel, ``numaserve status`` --
  aborts the whole supervisor (SIGABRT), and every worker dies with it.
* ``tcp_listener.cpp`` tolerates EMFILE but leaves the connection in the
  kernel queue; the listener stays readable, so its I/O thread spins.
* Spawning a worker needs fds too (the exec error pipe, the token pipe).

So: the soft limit is raised to the hard one at start (workers get the
original soft limit back: an app using ``select()`` breaks past fd 1024);
every listener a less trusted peer can reach has a connection cap sized so
that the caps, what the supervisor itself needs and a reserve fit under the
limit (``plan_caps``); and ``FdWatch`` counts open fds every second and says
once, with what holds them, when they come near the limit or a call failed
with EMFILE.
"""

from __future__ import annotations

import errno
import os
import resource
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import structlog

__all__ = [
    "FdWatch",
    "RESERVE",
    "describe_fds",
    "count_open_fds",
    "is_fd_exhaustion",
    "plan_caps",
    "raise_nofile",
    "restore_child_nofile",
]

log = structlog.get_logger("numaserve.supervisor")

#: Descriptors kept free for the supervisor itself: ops clients on the owner's
#: socket, audit writes, /proc reads, a respawn's pipes.
RESERVE = 32
#: Per slot: the control connections of the current, an incoming and a retiring worker.
PER_SLOT = 3
#: One spawn at a time: the exec error pipe and the token pipe.
SPAWN = 4
#: Connections a listener may accept in one event-loop turn before its cap closes them.
ACCEPT_SLACK = 16

_original_soft: int | None = None  # set when raise_nofile changed the soft limit


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 1 << 20


def raise_nofile() -> tuple[int, int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns (old soft, new soft, hard)."""
    global _original_soft
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _nr_open() if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            _original_soft = soft if _original_soft is None else _original_soft
            return soft, target, hard
        except (OSError, ValueError):
            pass
    return soft, soft, hard


def restore_child_nofile(pid: int) -> None:
    """Give a freshly spawned child the soft limit we started with (no-op when unchanged)."""
    if _original_soft is None:
        return
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (_original_soft, hard))
    except (OSError, ValueError):
        pass  # the child exited already, or another uid: it keeps ours


def current_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _nr_open() if soft == resource.RLIM_INFINITY else int(soft)


def count_open_fds() -> int | None:
    """Open descriptors of this process (None when /proc cannot be read, e.g. at EMFILE)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # minus the directory listdir opened
    except OSError:
        return None


def is_fd_exhaustion(exc: BaseException | None) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)


# --------------------------------------------------------------- what holds them


def _hex_addr(text: str) -> str:
    """``0100007F:1F90`` (from /proc/net/tcp) → ``127.0.0.1:8080``; IPv6 rendered compactly."""
    import socket

    host, _, port = text.partition(":")
    try:
        raw = bytes.fromhex(host)
        if len(raw) == 4:
            addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
        else:  # four little-endian 32-bit words
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
            addr = "[" + socket.inet_ntop(socket.AF_INET6, words) + "]"
        return f"{addr}:{int(port, 16)}"
    except (ValueError, OSError):
        return text


def _socket_table(proc: str) -> dict[str, str]:
    """inode → "tcp LOCAL listen|conn" / "unix PATH" for this process's network namespace."""
    out: dict[str, str] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(proc, "net", name)) as f:
                next(f, None)
                for line in f:
                    parts = line.split()
                    if len(parts) > 9:
                        state = "listen" if parts[3] == "0A" else "conn"
                        out[parts[9]] = f"tcp {_hex_addr(parts[1])} {state}"
        except OSError:
            pass
    try:
        with open(os.path.join(proc, "net", "unix")) as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) >= 7:
                    # accepted unix sockets show their listener's path
                    out[parts[6]] = "unix " + (parts[7] if len(parts) > 7 else "(unnamed)")
    except OSError:
        pass
    return out


def describe_fds(proc: str = "/proc/self", top: int = 8) -> dict[str, int]:
    """What holds this process's fds, most first: ``{"tcp 127.0.0.1:9180 conn": 64, "pipe": 2, ...}``."""
    try:
        names = os.listdir(os.path.join(proc, "fd"))
    except OSError:
        return {}
    table: dict[str, str] | None = None
    kinds: Counter[str] = Counter()
    for n in names:
        try:
            target = os.readlink(os.path.join(proc, "fd", n))
        except OSError:
            continue
        if target.startswith("socket:["):
            if table is None:
                table = _socket_table(proc)
            kinds[table.get(target[8:-1], "socket (other)")] += 1
        elif target.startswith("pipe:["):
            kinds["pipe"] += 1
        elif target.startswith("anon_inode:"):
            kinds[target[len("anon_inode:"):].strip("[]")] += 1
        else:
            kinds["file"] += 1
    return dict(kinds.most_common(top))


# ---------------------------------------------------------------------- budget


@dataclass(frozen=True)
class CapsPlan:
    limit: int
    baseline: int
    needed_by_supervisor: int     # baseline + workers + spawn + reserve
    caps: dict[str, int]
    wanted: dict[str, int]
    scaled: bool

    def to_json(self) -> dict[str, Any]:
        return {"limit": self.limit, "baseline": self.baseline, "reserved_for_supervisor": self.needed_by_supervisor,
                "caps": dict(self.caps), "wanted": dict(self.wanted), "scaled_down": self.scaled}


def plan_caps(limit: int, baseline: int, slots: int, wanted: Mapping[str, tuple[int, int]], *,
              reserve: int = RESERVE) -> CapsPlan:
    """Connection caps per listener that fit under ``limit``.

    ``wanted``: listener → (configured cap, fds one connection costs).  When
    they do not all fit, every cap is scaled down by the same factor (at
    least 1 connection each), so an operator at a tiny limit still gets each
    endpoint, just narrower.  Pure.
    """
    # plus one accept batch per listener: accepted before the cap can close them
    fixed = baseline + slots * PER_SLOT + SPAWN + reserve + ACCEPT_SLACK * len(wanted)
    avail = max(0, limit - fixed)
    cost = sum(cap * per for cap, per in wanted.values())
    if cost <= avail or cost == 0:
        caps = {k: cap for k, (cap, _) in wanted.items()}
        scaled = False
    else:
        factor = avail / cost
        caps = {k: max(1, int(cap * factor)) for k, (cap, _) in wanted.items()}
        scaled = True
    return CapsPlan(limit=limit, baseline=baseline, needed_by_supervisor=fixed, caps=caps,
                    wanted={k: cap for k, (cap, _) in wanted.items()}, scaled=scaled)


# ----------------------------------------------------------------------- watch


@dataclass
class FdWatch:
    """Open fds against the limit, sampled once a second; one log line per episode.

    An episode starts when the count passes ``limit - reserve / 2`` or a call
    fails with EMFILE/ENFILE (``note_exhaustion``), and ends when the count
    is back under ``limit - reserve``.  A spare descriptor is held so that
    even at the limit there is one to read ``/proc`` with.
    """

    limit: int
    reserve: int = RESERVE
    counter: Callable[[], int | None] = count_open_fds
    describe: Callable[[], dict[str, int]] = describe_fds
    open_fds: int | None = None
    peak: int = 0
    exhaustion: int = 0
    last_exhaustion: str | None = None
    pressure: bool = False
    _spare: int = field(default=-1, repr=False)
    _last_exhaustion_at: float = field(default=-1e9, repr=False)

    def __post_init__(self) -> None:
        try:
            self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._spare = -1

    def _diagnose(self) -> dict[str, int]:
        if self._spare >= 0:
            os.close(self._spare)
            self._spare = -1
        try:
            return self.describe()
        finally:
            try:
                self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._spare = -1

    def tick(self) -> None:
        n = self.counter()
        if n is None:  # could not even list /proc/self/fd: we are at the limit
            n = self.limit
        self.open_fds = n
        self.peak = max(self.peak, n)
        if not self.pressure and n >= self.limit - self.reserve // 2:
            self.pressure = True
            log.error("fd_pressure", open_fds=n, limit=self.limit, held_by=self._diagnose(),
                      fix="raise LimitNOFILE= (systemd) / ulimit -n (the admin and ops connection caps are fixed)")
        elif self.pressure and n < self.limit - self.reserve:
            self.pressure = False
            log.info("fd_pressure_over", open_fds=n, limit=self.limit)

    def note_exhaustion(self, where: str, exc: BaseException | None = None) -> None:
        """A call failed with EMFILE/ENFILE: count it (once a second at most: asyncio reports
        every retry of its accept loop); log it once per episode."""
        now = time.monotonic()
        if now - self._last_exhaustion_at >= 1.0:
            self._last_exhaustion_at = now
            self.exhaustion += 1
        self.last_exhaustion = f"{where}: {getattr(exc, 'strerror', None) or exc}"
        if not self.pressure:
            self.pressure = True
            log.error("fd_exhausted", where=where, error=str(exc) if exc else None, limit=self.limit,
                      open_fds=self.counter(), held_by=self._diagnose(),
                      fix="raise LimitNOFILE= (systemd) / ulimit -n, or lower the connection caps")

    def status(self) -> dict[str, Any]:
        return {"open": self.open_fds, "peak": self.peak, "limit": self.limit, "reserve": self.reserve,
                "exhausted": self.exhaustion, "last_exhausted": self.last_exhaustion, "pressure": self.pressure}

    def close(self) -> None:
        if self._spare >= 0:
            os.close(self._spare)
            self._spare = -1
