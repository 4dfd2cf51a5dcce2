"""NIC IRQ steering: put each queue interrupt of a NIC on a CPU of the NIC's node.

Why: a packet's RX softirq runs on the CPU its queue interrupt fires on, and
that CPU is what the reuseport CBPF program (``numaserve.net.steering``) uses to
pick a NUMA-local listener.  Interrupts on the wrong node make every request
cross the interconnect twice.

Three layers, as everywhere in numaserve:

* ``plan_irqs`` is pure: Topology + settings → ``IrqPlan`` (no file access;
  ``numaserve.net.irqplan``, re-exported here).
* ``apply_plan`` / ``restore`` are the thin I/O shell over a root path
  (``/`` on a real machine, a copied fixture tree in tests).  All file access
  goes through an ``AffinityIO`` so tests can inject kernel write errors
  (EIO, EPERM, ERANGE, ENOSPC …) that regular files never produce.
* ``numaserve.cli.irq_cmd`` is the CLI.

Facts (FACTS-numa-irq-reuseport.md §5, §6): write ``smp_affinity_list`` with
``os.open`` + ``os.write`` (a buffered write only fails at close), read back
first (idempotent), map errno per IRQ, never stop at the first error, and
never fight irqbalance silently.
"""

from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

from numaserve.config import IrqSettings
from numaserve.cpulist import ListSyntaxError, format_list, parse_list, parse_mask
from numaserve.errors import NumaserveError, UsageError
from numaserve.net.irqplan import (
    IrqbalanceConflict,
    IrqEntry,
    IrqPlan,
    QueueFileEntry,
    SkippedIrq,
    irqbalance_fixes,
    irqbalance_message,
    order_cores_first,
    plan_irqs,
)

__all__ = [
    "IrqSettings",
    "IrqEntry",
    "QueueFileEntry",
    "SkippedIrq",
    "IrqPlan",
    "IrqResult",
    "FileResult",
    "ApplyResult",
    "RestoreResult",
    "AffinityIO",
    "FileIO",
    "IrqbalanceConflict",
    "plan_irqs",
    "apply_plan",
    "restore",
    "order_cores_first",
    "irqbalance_fixes",
    "default_state_file",
    "DEFAULT_STATE_DIR",
]

DEFAULT_STATE_DIR = "/var/lib/numaserve"
STATE_VERSION = 1


def default_state_file(settings: IrqSettings | None = None, runtime_dir: str = "") -> str:
    """Where the original affinities are saved: explicit setting, else runtime dir, else /var/lib."""
    if settings is not None and settings.state_file:
        return settings.state_file
    return os.path.join(runtime_dir or DEFAULT_STATE_DIR, "irq-saved.json")


# --- I/O shell -------------------------------------------------------------------


class AffinityIO(Protocol):
    """File access used by apply/restore; swap it in tests to inject kernel errors."""

    def read(self, path: str) -> str | None:
        """The stripped contents, or None when the file does not exist."""

    def write(self, path: str, text: str) -> None:
        """Write ``text``; raise ``OSError`` with the kernel's errno."""


class FileIO:
    """Real file access.  Writes with ``os.open`` + ``os.write`` so the kernel's
    error comes back from the write itself (a buffered write reports it only
    at close).  ``O_TRUNC`` is harmless on procfs/sysfs and needed on regular
    files (fixture trees)."""

    def read(self, path: str) -> str | None:
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                return f.read().strip()
        except FileNotFoundError:
            return None

    def write(self, path: str, text: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
        try:
            data = text.encode("ascii")
            n = os.write(fd, data)
            if n != len(data):
                raise OSError(errno.EIO, f"short write ({n} of {len(data)} bytes)", path)
        finally:
            os.close(fd)


def _irq_path(root: str, irq: int, name: str = "smp_affinity_list") -> str:
    return os.path.join(root, "proc", "irq", str(irq), name)


_MANAGED = {errno.EIO, errno.EPERM}
_BAD_MASK = {errno.ERANGE, errno.EOVERFLOW, errno.EINVAL}
FAILED_STATUSES = frozenset({"bad-mask", "failed", "missing", "mismatch"})


def _errname(e: OSError) -> str:
    code = e.errno or 0
    return f"{errno.errorcode.get(code, str(code))}: {e.strerror or os.strerror(code)}"


@dataclass(frozen=True)
class IrqResult:
    """What happened to one IRQ.

    ``status``: "ok" (written), "unchanged" (already right), "managed"
    (kernel refuses user affinity: EIO/EPERM, skipped), "bad-mask"
    (ERANGE/EOVERFLOW/EINVAL: our bug), "failed" (other errno, or ENOSPC on
    every candidate CPU), "missing" (no /proc/irq/N), "mismatch" (written but
    read back differently).
    """

    irq: int
    nic: str | None
    name: str | None
    status: str
    before: str | None = None
    after: str | None = None
    error: str | None = None
    note: str | None = None

    @property
    def failed(self) -> bool:
        return self.status in FAILED_STATUSES

    def to_json(self) -> dict[str, Any]:
        return {
            "irq": self.irq,
            "nic": self.nic,
            "name": self.name,
            "status": self.status,
            "before": self.before,
            "after": self.after,
            "error": self.error,
            "note": self.note,
        }


@dataclass(frozen=True)
class FileResult:
    """An RPS/XPS file: "ok", "unchanged", "absent" (tolerated) or "failed"."""

    path: str
    status: str
    before: str | None = None
    after: str | None = None
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "status": self.status, "before": self.before, "after": self.after,
                "error": self.error}


@dataclass
class ApplyResult:
    irqs: list[IrqResult] = field(default_factory=list)
    files: list[FileResult] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    state_file: str = ""
    saved: int = 0

    @property
    def failed(self) -> list[IrqResult | FileResult]:
        return [r for r in [*self.irqs, *self.files] if r.failed]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "irqs": [r.to_json() for r in self.irqs],
            "files": [r.to_json() for r in self.files],
            "warnings": list(self.warnings),
            "state_file": self.state_file,
            "saved": self.saved,
            "failed": len(self.failed),
        }


@dataclass
class RestoreResult(ApplyResult):
    state_removed: bool = False
    nothing_saved: bool = False

    def to_json(self) -> dict[str, Any]:
        d = super().to_json()
        d["state_removed"] = self.state_removed
        d["nothing_saved"] = self.nothing_saved
        return d


# --- state file ----------------------------------------------------------------------


def _load_state(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise NumaserveError(f"irq: cannot read state file {path}: {e}") from None
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        raise NumaserveError(f"irq: state file {path} has an unknown format; inspect and remove it by hand")
    data.setdefault("irqs", {})
    data.setdefault("files", {})
    data.setdefault("labels", {})
    return data


def _write_state(path: str, data: Mapping[str, Any]) -> None:
    """Atomic: temp file in the same directory, fsync, rename, fsync the directory."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, mode=0o755, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    blob = (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, blob)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    try:
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def _check_state_root(state: Mapping[str, Any], root: str, path: str) -> None:
    saved_root = state.get("root")
    if saved_root is not None and os.path.abspath(saved_root) != os.path.abspath(root):
        raise UsageError(
            f"irq: state file {path} was saved for root {saved_root!r}, not {root!r}; "
            f"pass --root {saved_root} or another --state-file"
        )


# --- apply ---------------------------------------------------------------------------


def _write_cpus(
    io: AffinityIO, path: str, candidates: Sequence[int]
) -> tuple[str, str | None, str | None, str | None]:
    """Write the first candidate; on ENOSPC move on to the next.

    Returns (status, written text, error, note).
    """
    nospace: list[int] = []
    for cpu in candidates:
        text = format_list((cpu,))
        try:
            io.write(path, text + "\n")
        except OSError as e:
            if e.errno == errno.ENOSPC:
                nospace.append(cpu)
                continue
            if e.errno in _MANAGED:
                return "managed", None, _errname(e), (
                    "kernel-managed IRQ: user space cannot set its affinity; skipped"
                )
            if e.errno in _BAD_MASK:
                return "bad-mask", text, _errname(e), (
                    f"kernel rejected the mask {text!r}: a numaserve bug (CPU not present or offline?)"
                )
            return "failed", text, _errname(e), None
        note = None
        if nospace:
            note = f"ENOSPC (no free vector) on CPU {format_list(nospace)}; placed on CPU {cpu} instead"
        return "ok", text, None, note
    return "failed", None, "ENOSPC: no free interrupt vector", (
        f"no free vector on any candidate CPU ({format_list(nospace)})"
    )


def apply_plan(
    plan: IrqPlan,
    root: str = "/",
    state_file: str | None = None,
    *,
    force: bool = False,
    io: AffinityIO | None = None,
) -> ApplyResult:
    """Write the plan under ``root``, saving every original value first.

    Idempotent: an IRQ whose ``smp_affinity_list`` already equals the target
    is not written.  The original values go to ``state_file`` (atomic JSON)
    the first time an IRQ is touched; a later apply only adds IRQs not saved
    yet, so the state always holds the values from before numaserve.
    Refuses (``IrqbalanceConflict``) when irqbalance runs in "refuse" mode
    unless ``force``.
    """
    io = io or FileIO()
    state_file = state_file or default_state_file()
    result = ApplyResult(state_file=state_file)
    if plan.irqbalance_running:
        if plan.irqbalance_mode == "refuse" and not force:
            raise IrqbalanceConflict(irqbalance_message(plan))
        pids = ", ".join(str(p) for p in plan.irqbalance_pids) or "unknown pid"
        irqs = [e.irq for e in plan.entries]
        result.warnings.append(
            f"irqbalance is running (pid {pids}) and will overwrite these affinities within ~10 s; "
            f"fix: " + "; ".join(irqbalance_fixes(irqs, sorted({c for e in plan.entries for c in e.target})))
        )
    result.warnings.extend(plan.warnings)

    state = _load_state(state_file)
    if state is None:
        state = {"version": STATE_VERSION, "root": os.path.abspath(root), "created": time.time(),
                 "irqs": {}, "labels": {}, "files": {}}
    else:
        _check_state_root(state, root, state_file)

    # 1. read everything back, decide what to write, save originals before any write.
    todo_irqs: list[tuple[IrqEntry, str, str]] = []
    added: list[tuple[str, str]] = []
    for e in plan.entries:
        path = _irq_path(root, e.irq)
        cur = io.read(path)
        if cur is None:
            result.irqs.append(IrqResult(e.irq, e.nic, e.name, "missing", error=f"{path} does not exist"))
            continue
        if _same_cpus(cur, e.target):
            result.irqs.append(IrqResult(e.irq, e.nic, e.name, "unchanged", before=cur, after=cur))
            continue
        key = str(e.irq)
        if key not in state["irqs"]:
            state["irqs"][key] = cur
            state["labels"][key] = {"nic": e.nic, "name": e.name}
            added.append(("irqs", key))
        todo_irqs.append((e, path, cur))
    todo_files: list[tuple[QueueFileEntry, str, str]] = []
    for q in plan.queue_files:
        path = os.path.join(root, q.path)
        cur = io.read(path)
        if cur is None:
            result.files.append(FileResult(q.path, "absent"))
            continue
        if _same_mask(cur, q.cpus):
            result.files.append(FileResult(q.path, "unchanged", before=cur, after=cur))
            continue
        if q.path not in state["files"]:
            state["files"][q.path] = cur
            added.append(("files", q.path))
        todo_files.append((q, path, cur))
    if added:
        _write_state(state_file, state)
        result.saved = len(added)

    # 2. write; every IRQ gets its own verdict.
    untouched: list[tuple[str, str]] = []
    for e, path, cur in todo_irqs:
        status, written, err, note = _write_cpus(io, path, e.candidates)
        after = io.read(path) if written is not None or status == "ok" else cur
        if status == "ok" and written is not None and (after is None or not _same_cpus(after, parse_list(written))):
            status, err = "mismatch", f"wrote {written!r} but read back {after!r}"
        if status not in ("ok", "mismatch"):  # the kernel rejected every write: value unchanged
            untouched.append(("irqs", str(e.irq)))
        result.irqs.append(IrqResult(e.irq, e.nic, e.name, status, before=cur, after=after, error=err, note=note))
    for q, path, cur in todo_files:
        try:
            io.write(path, q.mask + "\n")
        except OSError as ex:
            untouched.append(("files", q.path))
            result.files.append(FileResult(q.path, "failed", before=cur, error=_errname(ex)))
            continue
        result.files.append(FileResult(q.path, "ok", before=cur, after=io.read(path)))

    # 3. forget originals of things we never changed (a restore would only fail on them).
    drop = [k for k in untouched if k in added]
    if drop:
        for section, key in drop:
            state[section].pop(key, None)
            if section == "irqs":
                state["labels"].pop(key, None)
        result.saved -= len(drop)
        _write_state(state_file, state)
    result.irqs.sort(key=lambda r: r.irq)
    return result


def _same_cpus(text: str, cpus: Sequence[int]) -> bool:
    try:
        return parse_list(text) == tuple(sorted(set(cpus)))
    except ListSyntaxError:
        return False


def _parse_or_empty(text: str) -> tuple[int, ...]:
    try:
        return parse_list(text)
    except ListSyntaxError:
        return ()


def _same_mask(text: str, cpus: Sequence[int]) -> bool:
    try:
        return parse_mask(text) == tuple(sorted(set(cpus)))
    except ListSyntaxError:
        return False


# --- restore -------------------------------------------------------------------------


def restore(root: str = "/", state_file: str | None = None, *, io: AffinityIO | None = None) -> RestoreResult:
    """Put every saved value back exactly as it was, then remove the state file.

    The state file is kept when anything could not be restored (so a second
    ``restore`` can retry); an IRQ that no longer exists (device gone) does
    not block removal.
    """
    io = io or FileIO()
    state_file = state_file or default_state_file()
    result = RestoreResult(state_file=state_file)
    state = _load_state(state_file)
    if state is None:
        result.nothing_saved = True
        result.warnings.append(f"no saved state at {state_file}: nothing to restore")
        return result
    _check_state_root(state, root, state_file)
    for key, saved in sorted(state["irqs"].items(), key=lambda kv: int(kv[0])):
        irq = int(key)
        label = state["labels"].get(key) or {}
        nic, name = label.get("nic"), label.get("name")
        path = _irq_path(root, irq)
        cur = io.read(path)
        if cur is None:
            result.irqs.append(IrqResult(irq, nic, name, "gone", note=f"{path} no longer exists"))
            continue
        if cur == saved or _same_cpus(cur, _parse_or_empty(saved)):
            result.irqs.append(IrqResult(irq, nic, name, "unchanged", before=cur, after=cur))
            continue
        try:
            io.write(path, saved + "\n")
        except OSError as e:
            if e.errno in _MANAGED:
                st = "managed"
            elif e.errno in _BAD_MASK:
                st = "bad-mask"
            else:
                st = "failed"
            result.irqs.append(IrqResult(irq, nic, name, st, before=cur, error=_errname(e)))
            continue
        after = io.read(path)
        st = "ok" if after is not None and _same_cpus(after, _parse_or_empty(saved)) else "mismatch"
        result.irqs.append(IrqResult(irq, nic, name, st, before=cur, after=after,
                                     error=None if st == "ok" else f"wrote {saved!r}, read back {after!r}"))
    for rel, saved in sorted(state["files"].items()):
        path = os.path.join(root, rel)
        cur = io.read(path)
        if cur is None:
            result.files.append(FileResult(rel, "absent"))
            continue
        if cur == saved:
            result.files.append(FileResult(rel, "unchanged", before=cur, after=cur))
            continue
        try:
            io.write(path, saved + "\n")
        except OSError as e:
            result.files.append(FileResult(rel, "failed", before=cur, error=_errname(e)))
            continue
        result.files.append(FileResult(rel, "ok", before=cur, after=io.read(path)))
    # a managed IRQ was never changed by us (apply drops it from the state), and
    # a vanished one has nothing to restore: neither keeps the state file.
    blocking: list[IrqResult | FileResult] = [r for r in result.irqs if r.failed]
    blocking += [r for r in result.files if r.failed]
    if not blocking:
        try:
            os.unlink(state_file)
        except FileNotFoundError:
            pass
        result.state_removed = True
    else:
        result.warnings.append(f"kept {state_file}: {len(blocking)} value(s) could not be restored; retry later")
    return result
