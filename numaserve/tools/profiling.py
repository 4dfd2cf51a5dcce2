"""Sample a worker with py-spy, and say plainly why when that is not possible.

py-spy reads the target's memory from outside (process_vm_readv), so the
worker needs no cooperation and no restart, but the kernel must allow it:
same user and ``kernel.yama.ptrace_scope`` 0, or root / CAP_SYS_PTRACE for
scopes 1 and 2, and nobody at all at scope 3.  ``ptrace_denial`` predicts a
refusal from those facts so the operator gets the cause, not py-spy's
generic "Permission Denied".
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from numaserve.errors import NumaserveError, UsageError

__all__ = [
    "FORMATS",
    "INSTALL_HINT",
    "ProfileResult",
    "default_output",
    "explain_failure",
    "find_py_spy",
    "has_cap_sys_ptrace",
    "ptrace_denial",
    "ptrace_scope",
    "py_spy_argv",
    "record",
    "slot_worker_pid",
]

#: --format -> file extension of what py-spy writes
FORMATS: dict[str, str] = {"flamegraph": ".svg", "speedscope": ".json", "raw": ".txt"}
INSTALL_HINT = "py-spy is not installed: install the profile extra: pip install 'numaserve[profile]'"
CAP_SYS_PTRACE = 19

_SCOPES = {
    0: "classic: same-user processes may be traced",
    1: "restricted: only a parent may attach, others need CAP_SYS_PTRACE",
    2: "admin-only: CAP_SYS_PTRACE required",
    3: "disabled: no process may attach until reboot",
}


def find_py_spy() -> str | None:
    """py-spy on PATH, or next to this Python (a venv that is not activated)."""
    found = shutil.which("py-spy")
    if found:
        return found
    cand = Path(sys.executable).parent / "py-spy"
    return str(cand) if cand.is_file() and os.access(cand, os.X_OK) else None


def ptrace_scope(path: str = "/proc/sys/kernel/yama/ptrace_scope") -> int | None:
    """Yama's ptrace_scope, or None when Yama is not in the kernel."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def has_cap_sys_ptrace(status_path: str = "/proc/self/status") -> bool:
    """Whether this process holds CAP_SYS_PTRACE (effective)."""
    try:
        with open(status_path) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return os.geteuid() == 0


def _uid_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def ptrace_denial(pid: int, *, euid: int | None = None, cap: bool | None = None, scope: int | None | str = "read",
                  target_uid: int | None | str = "read") -> str | None:
    """Why attaching to ``pid`` will be refused, or None when it should work.

    The facts default to this process and the live system; tests pass them in.
    """
    euid = os.geteuid() if euid is None else euid
    cap = has_cap_sys_ptrace() if cap is None else cap
    scope = ptrace_scope() if scope == "read" else scope
    target_uid = _uid_of(pid) if target_uid == "read" else target_uid
    need = "ptrace: needs root or CAP_SYS_PTRACE"
    if scope == 3:
        return (f"cannot attach to pid {pid}: kernel.yama.ptrace_scope = 3 ({_SCOPES[3]}); "
                f"profiling is impossible on this boot")
    if cap:
        return None
    if scope in (1, 2):
        return (f"cannot attach to pid {pid}: {need}; kernel.yama.ptrace_scope = {scope} ({_SCOPES[scope]}). "
                f"Run as root, grant CAP_SYS_PTRACE (containers: --cap-add SYS_PTRACE), "
                f"or set kernel.yama.ptrace_scope=0")
    if target_uid is not None and target_uid != euid:
        return (f"cannot attach to pid {pid}: it runs as uid {target_uid}, you are uid {euid} ({need})")
    return None


def explain_failure(output: str, pid: int, returncode: int) -> str:
    """One line for a failed py-spy run: the cause when known, else its last error line."""
    text = output.strip()
    low = text.lower()
    if "permission denied" in low or "operation not permitted" in low or "os error 1)" in low:
        why = ptrace_denial(pid)
        if why:
            return why
        scope = ptrace_scope()
        extra = "" if scope is None else f"; kernel.yama.ptrace_scope = {scope}"
        return (f"cannot attach to pid {pid}: permission denied (ptrace: needs root or CAP_SYS_PTRACE{extra}; "
                f"in a container add --cap-add SYS_PTRACE)")
    if "no stack counts found" in low:
        return ("no samples: the worker ran no Python code while sampled (idle?); put load on it "
                "(e.g. numaserve loadtest) or pass --idle")
    if "failed to get process executable name" in low or "no such process" in low:
        return f"pid {pid} is gone (the worker exited or was restarted); try again"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("py-spy>")]
    errors = [ln for ln in lines if ln.startswith("Error:")]
    last = errors[-1] if errors else (lines[-1] if lines else "no output")
    return f"py-spy failed (exit {returncode}): {last}"


def slot_worker_pid(status: Mapping[str, Any], slot: int) -> int:
    """The serving worker's pid of ``slot`` in a status snapshot."""
    slots = status.get("slots") or []
    for s in slots:
        if s.get("slot") == slot:
            if not s.get("pid"):
                raise NumaserveError(f"slot {slot} has no worker (state {s.get('state', '?')})")
            return int(s["pid"])
    known = ", ".join(str(s.get("slot")) for s in slots) or "none"
    raise UsageError(f"no slot {slot} (slots: {known})")


def default_output(slot: int, pid: int, fmt: str, now: float | None = None) -> Path:
    """A name that says what was sampled and when, so profiles from several runs do not clash."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path(f"numaserve-slot{slot}-pid{pid}-{stamp}{FORMATS[fmt]}")


def py_spy_argv(py_spy: str, pid: int, *, duration: int, fmt: str, output: Path, rate: int,
                native: bool = False, idle: bool = False, nonblocking: bool = False) -> list[str]:
    """The ``py-spy record`` command line (py-spy takes whole seconds)."""
    argv = [py_spy, "record", "--pid", str(pid), "--duration", str(max(1, int(duration))),
            "--rate", str(rate), "--format", fmt, "--output", str(output)]
    if native:
        argv.append("--native")
    if idle:
        argv.append("--idle")
    if nonblocking:
        argv.append("--nonblocking")
    return argv


@dataclass(frozen=True)
class ProfileResult:
    pid: int
    format: str
    output: Path
    samples: int | None
    errors: int | None
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "format": self.format, "output": str(self.output), "samples": self.samples,
                "errors": self.errors, "seconds": round(self.seconds, 2)}


_SAMPLES_RE = re.compile(r"Samples:\s*(\d+)\s+Errors:\s*(\d+)")


def record(pid: int, *, duration: int, fmt: str, output: Path, rate: int = 100, native: bool = False,
           idle: bool = False, nonblocking: bool = False, py_spy: str | None = None) -> ProfileResult:
    """Run ``py-spy record`` against ``pid``; raise ``NumaserveError`` with the cause.

    Ctrl-C stops sampling early: py-spy (same process group) still writes the file.
    """
    if fmt not in FORMATS:
        raise UsageError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    exe = py_spy or find_py_spy()
    if exe is None:
        raise NumaserveError(INSTALL_HINT)
    if not os.path.exists(f"/proc/{pid}"):
        raise NumaserveError(f"pid {pid} is gone (the worker exited or was restarted); try again")
    why = ptrace_denial(pid)
    if why:
        raise NumaserveError(why)
    argv = py_spy_argv(exe, pid, duration=duration, fmt=fmt, output=output, rate=rate, native=native,
                       idle=idle, nonblocking=nonblocking)
    env = dict(os.environ, RUST_BACKTRACE="0", RUST_LIB_BACKTRACE="0")
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, text=True, errors="replace")
    try:
        out, _ = proc.communicate(timeout=duration + 60)
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)       # harmless if it already got the terminal's SIGINT
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise NumaserveError(f"py-spy did not finish within {duration + 60:g}s; killed it") from None
    seconds = time.monotonic() - t0
    if proc.returncode != 0:
        if output.exists() and fmt == "flamegraph":
            output.unlink()                   # py-spy leaves a truncated SVG behind
        raise NumaserveError(explain_failure(out, pid, proc.returncode))
    if not output.exists():
        raise NumaserveError(f"py-spy exited 0 but wrote no {output}")
    m = _SAMPLES_RE.search(out)
    samples, errors = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    return ProfileResult(pid, fmt, output.resolve(), samples, errors, seconds)
