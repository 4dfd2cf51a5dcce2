"""Why did a worker exit, and should the slot pay for it?

Crash accounting has to tell a crash loop (the app dies on its own, quickly,
repeatedly) from a worker being killed from outside while it served: the
OOM killer, an operator's ``kill -9``, a stray SIGTERM.  The first is the
slot's fault and, repeated, makes it ``failed``; the second is restarted at
once and only counted and shown (status ``restarts_by_kind``, the
``numaserve_worker_exits_total{kind}`` metric).

Pure: ``classify_exit`` takes what the supervisor knows and returns a verdict.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

__all__ = ["EXPECTED", "EXTERNAL", "CRASH", "BOOT", "HANG", "KINDS", "ExitVerdict", "classify_exit",
           "EXTERNAL_SIGNALS", "oom_kill_count", "cgroup_dir", "cgroup_oom_kills", "cgroup_memory_max"]

EXPECTED = "expected"   # we asked it to stop (stop, drain, replace)
EXTERNAL = "external"   # killed or stopped from outside while serving
CRASH = "crash"         # died on its own while serving (non-zero exit, SIGSEGV, SIGABRT, ...)
BOOT = "boot"           # died before it was ever ready (import error, crash during start-up)
HANG = "hang"           # we killed it: no heartbeat, or not ready in time
KINDS = (EXTERNAL, CRASH, BOOT, HANG)

#: Signals a process does not send itself when it fails: someone else did.
EXTERNAL_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})


@dataclass(frozen=True)
class ExitVerdict:
    kind: str
    counted: bool     # towards the slot's crash loop
    why: str          # one phrase for the log and status


def classify_exit(*, code: int, was_ready: bool, we_stopped: bool, we_killed: bool,
                  stopped_from_outside: bool = False, goodbye: str | None = None,
                  oom_killed: bool = False) -> ExitVerdict:
    """Classify one exit.

    ``we_stopped``: we sent Stop/Drain/SIGTERM and gave it a deadline (and did
    not then kill it for a hang).  ``we_killed``: the watchdog killed it
    (hang or ready timeout).  ``stopped_from_outside``: the watchdog found it
    frozen by SIGSTOP (state ``T`` in /proc) rather than hung by itself.
    ``goodbye``: the reason a Python worker gave on its way out.
    ``oom_killed``: the kernel's OOM-kill counter moved since the last look
    (``oom_kill_count``), so a SIGKILL was most likely the OOM killer's.
    """
    if we_stopped and not we_killed:
        return ExitVerdict(EXPECTED, False, "asked to stop")
    if we_killed:
        if stopped_from_outside:
            return ExitVerdict(EXTERNAL, False, "frozen from outside (SIGSTOP), then killed by the watchdog")
        return ExitVerdict(HANG, True, "killed by the watchdog")
    if not was_ready:
        # a kill from outside while loading (the OOM killer during a model load, an operator's
        # kill -9) is not the app's own boot failure: retried at once, never a crash loop
        sig = _signal_of(code)
        if sig in EXTERNAL_SIGNALS:
            hint = ""
            if sig == signal.SIGKILL:
                hint = " (OOM-killed: the oom_kill count went up)" if oom_killed else " (the OOM killer or an operator)"
            return ExitVerdict(EXTERNAL, False, f"{sig.name} from outside while loading{hint}")
        if goodbye and goodbye.startswith("stopped: SIG") and not we_stopped:
            return ExitVerdict(EXTERNAL, False, f"{goodbye.split(':', 1)[1].strip()} from outside while loading")
        return ExitVerdict(BOOT, True, "died before it was ready")
    if code < 0:
        try:
            sig = signal.Signals(-code)
        except ValueError:
            return ExitVerdict(CRASH, True, f"died of signal {-code}")
        if sig in EXTERNAL_SIGNALS:
            hint = ""
            if sig == signal.SIGKILL:
                hint = " (the OOM killer: the kernel's oom_kill count went up)" if oom_killed else \
                    " (the OOM killer or an operator)"
            return ExitVerdict(EXTERNAL, False, f"{sig.name} from outside while serving{hint}")
        return ExitVerdict(CRASH, True, f"died of {sig.name}")
    if goodbye and goodbye.startswith("stopped: SIG") and not we_stopped:
        # a Python worker handles SIGTERM gracefully and exits 0 saying so
        return ExitVerdict(EXTERNAL, False, f"{goodbye.split(':', 1)[1].strip()} from outside while serving")
    if code == 0:
        return ExitVerdict(CRASH, True, "exited on its own (status 0) while it should serve")
    return ExitVerdict(CRASH, True, f"exited on its own (status {code})")


def _signal_of(code: int) -> signal.Signals | None:
    if code >= 0:
        return None
    try:
        return signal.Signals(-code)
    except ValueError:
        return None


def cgroup_dir(pid: int, proc: str = "/proc", root: str = "/sys/fs/cgroup") -> str | None:
    """A live process's cgroup v2 directory (the ``0::`` line of /proc/PID/cgroup); None on v1 or when gone."""
    try:
        with open(f"{proc}/{pid}/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return root.rstrip("/") + line[3:].strip()
    except OSError:
        return None
    return None


def cgroup_oom_kills(directory: str) -> int | None:
    """``oom_kill`` of a cgroup's ``memory.events``: processes in it (or below) the OOM killer ended."""
    try:
        with open(f"{directory}/memory.events") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def cgroup_memory_max(directory: str) -> str | None:
    """The cgroup's ``memory.max`` as written there ("max" or bytes); None when unreadable."""
    try:
        with open(f"{directory}/memory.max") as f:
            return f.read().strip() or None
    except OSError:
        return None


def oom_kill_count(proc: str = "/proc") -> int | None:
    """The kernel's count of OOM kills (``oom_kill`` in /proc/vmstat, Linux >= 4.13;
    memory-cgroup OOM kills count too); None when unreadable."""
    try:
        with open(f"{proc}/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None
