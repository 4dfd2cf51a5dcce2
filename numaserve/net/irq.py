"""NIC IRQ steering: put each queue interrupt of a NIC on a CPU of the NIC's node.

Why: a packet's RX softirq runs on the CPU its queue interrupt fires on, and
that CPU is what the reuseport CBPF program (``numaserve.net.steering``) uses to
pick a NUMA-local listener.  Interrupts on the wrong node make every request
cross the interconnect twice.

Three layers, as everywhere in numaserve:

* ``plan_irqs`` is pure: Topology + settings → ``IrqPlan`` (no file access).
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
from typing import Any, Literal, Mapping, Protocol, Sequence

from numaserve.config import IrqSettings
from numaserve.cpulist import ListSyntaxError, format_list, format_mask, parse_list, parse_mask
from numaserve.errors import NumaserveError, UsageError
from numaserve.topology.model import Irq, Nic, Topology

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


# --- plan (pure) ----------------------------------------------------------------


@dataclass(frozen=True)
class IrqEntry:
    """One queue IRQ to steer.  ``candidates`` is the NIC's whole CPU set in
    preference order (used to retry elsewhere on ENOSPC)."""

    irq: int
    name: str | None
    nic: str
    queue: int | None
    current: tuple[int, ...] | None
    target: tuple[int, ...]
    candidates: tuple[int, ...]

    @property
    def changed(self) -> bool:
        return self.current != self.target

    def to_json(self) -> dict[str, Any]:
        return {
            "irq": self.irq,
            "name": self.name,
            "nic": self.nic,
            "queue": self.queue,
            "current": None if self.current is None else format_list(self.current),
            "target": format_list(self.target),
            "changed": self.changed,
        }


@dataclass(frozen=True)
class QueueFileEntry:
    """An RPS (``rx-N/rps_cpus``) or XPS (``tx-N/xps_cpus``) mask to write.

    ``path`` is relative to the root.  The file may be absent (XPS on some
    virtio guests): apply tolerates that.
    """

    nic: str
    kind: Literal["rps", "xps"]
    queue: int
    path: str
    cpus: tuple[int, ...]

    @property
    def mask(self) -> str:
        return format_mask(self.cpus)

    def to_json(self) -> dict[str, Any]:
        return {
            "nic": self.nic,
            "kind": self.kind,
            "queue": self.queue,
            "path": self.path,
            "cpus": format_list(self.cpus),
            "mask": self.mask,
        }


@dataclass(frozen=True)
class SkippedIrq:
    """A NIC or IRQ left alone, with the reason (and the fix, when there is one)."""

    nic: str
    irq: int | None
    name: str | None
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"nic": self.nic, "irq": self.irq, "name": self.name, "reason": self.reason}


@dataclass
class IrqPlan:
    entries: list[IrqEntry] = field(default_factory=list)
    skipped: list[SkippedIrq] = field(default_factory=list)
    queue_files: list[QueueFileEntry] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    policy: str = "shared"
    irqbalance_mode: str = "refuse"
    irqbalance_running: bool | None = None
    irqbalance_pids: tuple[int, ...] = ()

    @property
    def changes(self) -> list[IrqEntry]:
        return [e for e in self.entries if e.changed]

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "entries": [e.to_json() for e in self.entries],
            "skipped": [s.to_json() for s in self.skipped],
            "queue_files": [q.to_json() for q in self.queue_files],
            "warnings": list(self.warnings),
            "irqbalance": {
                "running": self.irqbalance_running,
                "pids": list(self.irqbalance_pids),
                "mode": self.irqbalance_mode,
            },
        }


def order_cores_first(cpus: Sequence[int], smt_siblings: Mapping[int, Sequence[int]]) -> tuple[int, ...]:
    """Order CPUs so every physical core's first thread comes before any second thread.

    Why: scaling.rst — "for interrupt handling, HT has shown no benefit", so
    the first N queues get N distinct cores and siblings are used only when
    there are more queues than cores.  ``smt_siblings`` maps a CPU to its
    ``thread_siblings_list`` (itself included); missing CPUs count as their
    own core.
    """
    chosen = set(cpus)
    cores: dict[tuple[int, ...], list[int]] = {}
    for c in sorted(chosen):
        key = tuple(sorted(set(smt_siblings.get(c, (c,))) | {c}))
        cores.setdefault(key, []).append(c)
    ordered_cores = sorted(cores.values(), key=lambda members: members[0])
    out: list[int] = []
    depth = max((len(m) for m in ordered_cores), default=0)
    for rank in range(depth):
        out.extend(m[rank] for m in ordered_cores if rank < len(m))
    return tuple(out)


def _nic_cpus(topo: Topology, nic: Nic, base: Sequence[int]) -> tuple[int, ...]:
    """``base`` ∩ local_cpus ∩ online ∩ allowed (FACTS §5.3).

    A NIC whose node was *declared* by the operator ignores sysfs local_cpus:
    the declaration exists because firmware locality is wrong or absent.
    """
    s = set(base) & set(topo.online_cpus) & set(topo.allowed_cpus)
    if nic.local_cpus and nic.numa_node_source != "declared":
        s &= set(nic.local_cpus)
    return tuple(sorted(s))


def _queue_order(irqs: Sequence[Irq]) -> dict[int, int]:
    """IRQ → position in the round-robin.  IRQs of the same queue (virtio
    input.N/output.N, rx-N/tx-N) share a position so they land on one CPU;
    queue IRQs with no number follow the numbered ones."""
    numbered = sorted({i.queue for i in irqs if i.queue is not None})
    pos = {q: k for k, q in enumerate(numbered)}
    out: dict[int, int] = {}
    nxt = len(numbered)
    for i in sorted(irqs, key=lambda i: i.irq):
        if i.queue is not None:
            out[i.irq] = pos[i.queue]
        else:
            out[i.irq] = nxt
            nxt += 1
    return out


def plan_irqs(
    topo: Topology,
    settings: IrqSettings | None = None,
    *,
    iface: str | None = None,
    reserved: Mapping[int, Sequence[int]] | None = None,
) -> IrqPlan:
    """Decide where every queue IRQ of every steerable NIC goes.  Pure.

    ``iface`` (a CLI flag) narrows to one NIC and wins over
    ``settings.interfaces``; an unknown name is a ``UsageError``.
    ``reserved`` maps node → CPUs kept for IRQs (``placement.reserved_irq_cpus``)
    and is used only with ``policy = "reserved"``.
    """
    settings = settings or IrqSettings()
    sysinfo = topo.system
    plan = IrqPlan(
        policy=settings.policy,
        irqbalance_mode=settings.irqbalance,
        irqbalance_running=sysinfo.irqbalance_running,
        irqbalance_pids=tuple(sysinfo.irqbalance_pids),
    )
    names = [n.name for n in topo.nics]
    wanted: list[str] | None
    if iface is not None:
        wanted = [iface]
    elif settings.interfaces:
        wanted = list(settings.interfaces)
    else:
        wanted = None
    if wanted is not None:
        missing = [w for w in wanted if w not in names]
        if missing:
            raise UsageError(
                f"irq: no physical NIC named {', '.join(missing)}; "
                f"found: {', '.join(names) if names else '(none)'}"
            )
    nics = [n for n in topo.nics if wanted is None or n.name in wanted]
    if not nics:
        plan.warnings.append("no physical NIC found: nothing to steer")

    for nic in nics:
        _plan_nic(topo, nic, settings, reserved, plan)
    return plan


def _skip_nic(plan: IrqPlan, nic: Nic, msg: str) -> None:
    """A NIC left alone: a warning for the operator and a skipped entry with the reason."""
    plan.warnings.append(msg)
    plan.skipped.append(SkippedIrq(nic.name, None, None, msg))


def _plan_nic(
    topo: Topology,
    nic: Nic,
    settings: IrqSettings,
    reserved: Mapping[int, Sequence[int]] | None,
    plan: IrqPlan,
) -> None:
    if nic.numa_node is None:
        msg = (
            f"{nic.name}: NUMA node unknown (sysfs numa_node -1 and local_cpulist covers all CPUs); "
            f"not steering its IRQs. Fix: declare it in a declared topology file: "
            f"[nic.{nic.name}] node = N"
        )
        _skip_nic(plan, nic, msg)
        return
    try:
        node = topo.node(nic.numa_node)
    except KeyError:
        msg = f"{nic.name}: NUMA node {nic.numa_node} is not in the topology; not steering"
        _skip_nic(plan, nic, msg)
        return
    shared = _nic_cpus(topo, nic, node.cpus)
    if settings.policy == "reserved":
        rset = tuple((reserved or {}).get(node.id, ()))
        cpus = _nic_cpus(topo, nic, set(rset) & set(node.cpus))
        if not cpus:
            msg = (
                f"{nic.name}: policy \"reserved\" but no usable reserved CPU on node {node.id} "
                f"(reserved: {format_list(rset) or 'none'}); set placement.reserve_irq_cpus > 0 "
                f"or use policy \"shared\""
            )
            _skip_nic(plan, nic, msg)
            return
    else:
        cpus = shared
    if not cpus:
        msg = (
            f"{nic.name}: no usable CPU on node {node.id} (node CPUs {format_list(node.cpus) or 'none'} "
            f"∩ NIC local CPUs ∩ online ∩ allowed is empty); not steering"
        )
        _skip_nic(plan, nic, msg)
        return
    ordered = order_cores_first(cpus, topo.smt_siblings)

    queue_irqs = []
    for irq in sorted(nic.irqs, key=lambda i: i.irq):
        if irq.kind == "queue":
            queue_irqs.append(irq)
        elif irq.kind == "admin":
            plan.skipped.append(SkippedIrq(nic.name, irq.irq, irq.name, "admin vector (config/async): left alone"))
        else:
            plan.skipped.append(
                SkippedIrq(
                    nic.name, irq.irq, irq.name,
                    "cannot tell from its name whether it is a queue vector: left alone",
                )
            )
    if not queue_irqs:
        plan.warnings.append(f"{nic.name}: no queue IRQ found (INTx or unknown names): nothing to steer")

    position = _queue_order(queue_irqs)
    queue_cpu: dict[int, int] = {}
    for irq in queue_irqs:
        p = position[irq.irq]
        cpu = ordered[p % len(ordered)]
        if irq.queue is not None:
            queue_cpu.setdefault(irq.queue, cpu)
        rest = tuple(c for c in ordered if c != cpu)
        plan.entries.append(
            IrqEntry(
                irq=irq.irq,
                name=irq.name,
                nic=nic.name,
                queue=irq.queue,
                current=irq.affinity,
                target=(cpu,),
                candidates=(cpu,) + rest,
            )
        )

    base = f"sys/class/net/{nic.name}/queues"
    if settings.rps:
        for q in range(nic.rx_queues):
            plan.queue_files.append(QueueFileEntry(nic.name, "rps", q, f"{base}/rx-{q}/rps_cpus", shared))
    if settings.xps:
        for q in range(nic.tx_queues):
            cpu = queue_cpu.get(q, ordered[q % len(ordered)])
            plan.queue_files.append(QueueFileEntry(nic.name, "xps", q, f"{base}/tx-{q}/xps_cpus", (cpu,)))


# --- irqbalance --------------------------------------------------------------------


def irqbalance_fixes(irqs: Sequence[int], cpus: Sequence[int]) -> list[str]:
    """The exact lines an operator adds so irqbalance leaves our IRQs alone.

    ``--banirq`` is precise (irqbalance never touches a banned IRQ);
    ``IRQBALANCE_BANNED_CPULIST`` additionally keeps *other* IRQs off the
    steered CPUs (useful with policy "reserved").  Both need a restart.
    """
    fixes: list[str] = []
    if irqs:
        args = " ".join(f"--banirq={i}" for i in sorted(set(irqs)))
        fixes.append(f'IRQBALANCE_ARGS="{args}"   (in /etc/default/irqbalance or /etc/sysconfig/irqbalance)')
    if cpus:
        fixes.append(
            f"IRQBALANCE_BANNED_CPULIST={format_list(cpus)}   (same file; keeps other IRQs off these CPUs)"
        )
    fixes.append("then: systemctl restart irqbalance")
    return fixes


class IrqbalanceConflict(NumaserveError):
    """irqbalance is running and the settings say refuse: applying would be undone in ~10 s."""


def _irqbalance_message(plan: IrqPlan) -> str:
    pids = ", ".join(str(p) for p in plan.irqbalance_pids) or "unknown pid"
    irqs = [e.irq for e in plan.entries]
    cpus = sorted({c for e in plan.entries for c in e.target})
    lines = [
        f"irqbalance is running (pid {pids}); it rebalances every 10 s and would overwrite these "
        f"affinities. Not applying (irq.irqbalance = \"refuse\"). Fixes (numaserve never kills it):",
    ]
    lines += [f"  {f}" for f in irqbalance_fixes(irqs, cpus)]
    lines.append("  or apply anyway: numaserve irq apply --force-with-irqbalance (or irq.irqbalance = \"warn\")")
    return "\n".join(lines)


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
            raise IrqbalanceConflict(_irqbalance_message(plan))
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
