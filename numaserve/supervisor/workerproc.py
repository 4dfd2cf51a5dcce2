"""Handles on worker processes the supervisor reaps: exec'd (``Popen``) and forked.

A worker forked from a node's warm template is not a child the supervisor
created: the template double-forks and the grandchild reparents to the
supervisor, which is a child subreaper (``PR_SET_CHILD_SUBREAPER``).  The
supervisor then reaps it with ``waitpid(pid)`` like any child, gets SIGCHLD
for it, and the template's own death does not touch it.

Why a subreaper rather than the template reaping and reporting exits: a
template is one process per node; if it crashed, every worker it forked
would be orphaned to init and their exit statuses lost.  With the
supervisor as the (sub)reaper, the supervision tree stays "supervisor →
every worker", exactly as with exec'd workers.

``ForkedProcess`` has the part of ``subprocess.Popen`` the supervisor uses
(``pid``, ``returncode``, ``poll``, ``wait``, ``kill``, ``send_signal``), so a
slot holds either without knowing which.  Strays (children the supervisor
never asked for, e.g. a ``--cmd`` server's own workers orphaned under a
subreaper) are reaped by pid from ``/proc``, never with ``waitpid(-1)``
(that would steal the statuses ``Popen`` waits for).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from typing import Iterable, Protocol

__all__ = ["ForkedProcess", "WorkerProcess", "child_pids", "reap_strays", "set_child_subreaper"]

_PR_SET_CHILD_SUBREAPER = 36


class WorkerProcess(Protocol):
    """What a slot needs of its worker process (``subprocess.Popen`` satisfies it)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...

    def send_signal(self, sig: int) -> None: ...


def _status_to_code(status: int) -> int:
    """waitpid status → Popen's convention (negative signal number when killed)."""
    return os.waitstatus_to_exitcode(status)


class ForkedProcess:
    """A worker forked by a template and reparented to us (we are its subreaper)."""

    def __init__(self, pid: int, *, template_pid: int | None = None, template_generation: int | None = None,
                 node: int | None = None) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.template_pid = template_pid
        self.template_generation = template_generation
        self.node = node
        self.started_by = "fork"

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            # not (or no longer) our child: someone reaped it, or it never reparented to us
            self.returncode = self._gone_code()
            return self.returncode
        if pid == 0:
            return None
        self.returncode = _status_to_code(status)
        return self.returncode

    def _gone_code(self) -> int:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return 255
        except PermissionError:
            pass
        return 255  # alive but not ours: we cannot supervise it; treat as gone

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        delay = 0.0005
        while True:
            code = self.poll()
            if code is not None:
                return code
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            return  # reaped: the pid may belong to someone else now
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __repr__(self) -> str:
        return f"ForkedProcess(pid={self.pid}, returncode={self.returncode}, template_pid={self.template_pid})"


def set_child_subreaper(on: bool = True) -> None:
    """prctl(PR_SET_CHILD_SUBREAPER): orphaned descendants reparent to us (OSError on failure)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1 if on else 0), ctypes.c_ulong(0),
                  ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(err)}")


def child_pids(proc: str = "/proc") -> list[int]:
    """Our children, from ``/proc/self/task/*/children`` (every thread's: children belong to threads)."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"{proc}/self/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"{proc}/self/task/{tid}/children") as f:
                out.extend(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    return out


def _is_zombie(pid: int, proc: str = "/proc") -> bool:
    try:
        with open(f"{proc}/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def reap_strays(known: Iterable[int], proc: str = "/proc") -> list[tuple[int, int]]:
    """Reap exited children that no handle owns; returns [(pid, exit code)].

    Only zombies are waited for, each by its own pid, so live children and
    the ones a ``Popen``/``ForkedProcess`` handle waits for are untouched.
    """
    keep = set(known)
    out = []
    for pid in child_pids(proc):
        if pid in keep or not _is_zombie(pid, proc):
            continue
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except OSError:  # gone already (ECHILD), or interrupted: the next tick tries again
            continue
        if got:
            out.append((got, _status_to_code(status)))
    return out
