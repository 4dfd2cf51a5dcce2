"""Process plumbing: spawn in a new session, measure a process tree's CPU, stop
everything we started (the bench must never leave a stray worker behind)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import psutil


_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A loopback port nobody listens on right now (small race accepted)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(argv: Sequence[str], *, env: dict[str, str], cwd: str | Path, log: Path,
          cpus: Iterable[int] | None = None) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own session (own process group), output to ``log``.

    ``cpus`` restricts the whole tree (children inherit the affinity), which is
    how a server is kept on one CPU while the load generator uses the other.
    """
    cpuset = set(cpus) if cpus is not None else None
    libc = ctypes.CDLL(None, use_errno=True)

    def _child_setup() -> None:  # runs in the child between fork and exec
        # if the bench dies (even by SIGKILL), the server gets SIGTERM and stops its workers
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if cpuset is not None:
            os.sched_setaffinity(0, cpuset)

    out = open(log, "ab")
    try:
        return subprocess.Popen(list(argv), env=env, cwd=str(cwd), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_child_setup)
    finally:
        out.close()


def descendants(pid: int) -> list[psutil.Process]:
    """Every live descendant of ``pid`` (empty when it is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _cpu_of(p: psutil.Process) -> float | None:
    try:
        t = p.cpu_times()
        return float(t.user + t.system)
    except psutil.Error:
        return None


@dataclass
class TreeCpu:
    """CPU seconds used by a process tree between ``start()`` and the last
    ``sample()``.  Processes that appear later count from zero; a process that
    exits keeps the last value seen (sample often to lose little)."""

    root: int
    include_children: bool = True
    _first: dict[tuple[int, float], float] = field(default_factory=dict)
    _last: dict[tuple[int, float], float] = field(default_factory=dict)

    def _procs(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.root)
        except psutil.Error:
            return []
        return [root, *descendants(self.root)] if self.include_children else [root]

    def start(self) -> "TreeCpu":
        self._first.clear()
        self._last.clear()
        for p in self._procs():
            v = _cpu_of(p)
            if v is not None:
                key = (p.pid, p.create_time())
                self._first[key] = v
                self._last[key] = v
        return self

    def sample(self) -> float:
        """Update and return the CPU seconds used since ``start()``."""
        for p in self._procs():
            v = _cpu_of(p)
            if v is None:
                continue
            try:
                key = (p.pid, p.create_time())
            except psutil.Error:
                continue
            self._first.setdefault(key, 0.0)
            self._last[key] = v
        return self.used

    @property
    def used(self) -> float:
        return sum(self._last[k] - self._first[k] for k in self._last)


def cpu_over(root: int, seconds: float, *, include_children: bool = True, step: float = 0.25,
             stop_after_idle_s: float | None = None) -> dict[str, Any]:
    """CPU seconds a tree uses over the next ``seconds``, and when it went idle
    (the start of the first 1 s window under 5 % of one CPU, or None).

    ``stop_after_idle_s`` ends the measurement early once the tree has been
    idle that long: what is left of the window would add only idle ticks.
    """
    meter = TreeCpu(root, include_children).start()
    t0 = time.monotonic()
    idle_at: float | None = None
    win_t, win_v = t0, 0.0
    while (now := time.monotonic()) - t0 < seconds:
        time.sleep(min(step, max(0.0, seconds - (now - t0))))
        v = meter.sample()
        now = time.monotonic()
        if now - win_t >= 1.0:
            if (v - win_v) / (now - win_t) < 0.05:
                if idle_at is None:
                    idle_at = win_t - t0
            else:
                idle_at = None
            win_t, win_v = now, v
            if stop_after_idle_s is not None and idle_at is not None and now - t0 - idle_at >= stop_after_idle_s:
                break
    return {"cpu_s": round(meter.sample(), 3), "window_s": round(time.monotonic() - t0, 2),
            "idle_after_s": None if idle_at is None else round(idle_at, 2)}


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def stop_tree(proc: subprocess.Popen[bytes], *, grace: float = 10.0) -> None:
    """SIGTERM the server (graceful), then SIGKILL whatever of its tree is left.

    Descendants are listed *before* the signal: numaserve workers live in
    their own process groups, so killing the supervisor's group is not enough.
    """
    tree = {(p.pid, _ctime(p)) for p in descendants(proc.pid)}
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    tree |= {(p.pid, _ctime(p)) for p in descendants(proc.pid)}
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 5.0
    for pid, ctime in tree:
        try:
            p = psutil.Process(pid)
            if ctime is not None and abs(p.create_time() - ctime) > 0.01:
                continue  # pid reused by somebody else's process
            p.kill()
        except psutil.Error:
            continue
    for pid, _ in tree:
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def _ctime(p: psutil.Process) -> float | None:
    try:
        return p.create_time()
    except psutil.Error:
        return None
