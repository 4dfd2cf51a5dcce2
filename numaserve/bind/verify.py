"""Read a process's CPU and memory placement back from /proc, and judge it.

Why from outside: the supervisor must not trust a worker's word for where it
runs; affinity and memory policy are per *thread*, so every thread in
``/proc/PID/task`` is read.  Parsing is pure (text in, data out) so it is
tested on hand-made trees; ``read_placement`` is the thin reader.

Task memory policy rule: ``/proc/PID/task/TID/numa_maps`` prints, for every
VMA without a policy of its own, the *thread's* policy.  We take the most
common policy token over the thread's ordinary VMAs (skipping special ones:
vdso/vvar lines with no pages or file, ``huge`` hugetlb VMAs, and shared or
device mappings ``file=/dev/...``, ``/SYSV...``, ``/memfd:...`` which can carry
their own shared policy); an ``mbind`` VMA is a minority and does not win.
Ties go to the first VMA in address order.  Only the first
``policy_sample_bytes`` of each thread's file are read: the kernel walks page
tables to print every line, so reading all of it per thread is expensive.
"""

from __future__ import annotations

import errno
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

from numaserve.cpulist import format_list, parse_list
from numaserve.bind.numa import MemPolicy, get_cpu_affinity, get_mempolicy, parse_numa_maps_token

__all__ = [
    "Vma",
    "ThreadPlacement",
    "ObservedPlacement",
    "parse_numa_maps",
    "task_policy_token",
    "read_numa_maps",
    "read_placement",
    "read_node_pages",
    "ANON_KINDS",
    "PlacementReader",
    "expected_policy",
    "policy_matches",
    "check_placement",
    "policy_notes",
    "check_self",
]

_LINE = re.compile(r"^([0-9a-f]+) (prefer \(many\)\S*|weighted interleave\S*|\S+)(.*)$")
_NODE = re.compile(r"^N(\d+)=(\d+)$")
_SPECIAL_FILE_PREFIXES = ("/dev/", "/SYSV", "/memfd:", "/dmabuf")
_ALIASES = {"prefer": "preferred", "preferred": "preferred", "membind": "bind"}


@dataclass(frozen=True)
class Vma:
    """One numa_maps line: start address, policy token, pages per node."""

    start: int
    policy: str
    pages: dict[int, int] = field(default_factory=dict)
    page_size_kb: int = 4
    anon: int = 0
    file: str | None = None
    kind: str = "other"  # "heap" | "stack" | "huge" | "file" | "anon" | "special"

    @property
    def total_pages(self) -> int:
        return sum(self.pages.values())

    @property
    def special(self) -> bool:
        return self.kind in ("special", "huge") or (
            self.file is not None and self.file.startswith(_SPECIAL_FILE_PREFIXES)
        )


@dataclass(frozen=True)
class ThreadPlacement:
    """One thread as seen in /proc: CPUs it may run on, its memory policy token.

    ``policy`` is None when it could not be read; ``policy_error`` says why.
    """

    tid: int
    name: str
    cpus: tuple[int, ...]
    policy: str | None
    mems_allowed: tuple[int, ...] | None = None
    policy_error: str | None = None


@dataclass(frozen=True)
class ObservedPlacement:
    """Every thread of ``pid`` plus the process's pages per node (whole numa_maps)."""

    pid: int
    threads: tuple[ThreadPlacement, ...]
    pages_per_node: dict[int, int]
    bytes_per_node: dict[int, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_per_node.values())

    def remote_share(self, nodes: Iterable[int]) -> float | None:
        """Fraction of resident bytes not on ``nodes`` (None when nothing is resident)."""
        local = set(nodes)
        total = self.total_bytes
        if not total:
            return None
        return sum(b for n, b in self.bytes_per_node.items() if n not in local) / total

    def policies(self) -> dict[str | None, list[int]]:
        """Policy token → thread ids (one key when all threads agree)."""
        out: dict[str | None, list[int]] = {}
        for t in self.threads:
            out.setdefault(t.policy, []).append(t.tid)
        return out


# ------------------------------------------------------------------- parsing


def parse_numa_maps(text: str) -> list[Vma]:
    """Parse ``numa_maps`` text; malformed lines are skipped (the file is read live)."""
    out: list[Vma] = []
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        start, policy, rest = int(m.group(1), 16), m.group(2), m.group(3).split()
        pages: dict[int, int] = {}
        psize, anon, fname, kind = 4, 0, None, "other"
        for tok in rest:
            nm = _NODE.match(tok)
            if nm:
                pages[int(nm.group(1))] = int(nm.group(2))
                continue
            key, eq, val = tok.partition("=")
            if not eq:
                if key in ("heap", "stack", "huge"):
                    kind = key
                continue
            if key == "kernelpagesize_kB" and val.isdigit():
                psize = int(val)
            elif key == "anon" and val.isdigit():
                anon = int(val)
            elif key == "file":
                fname = val.replace("\\040", " ")
        if kind == "other":
            if fname is not None:
                kind = "file"
            elif rest:
                kind = "anon"
            else:
                kind = "special"  # vdso / vvar / unpopulated: nothing to show
        out.append(Vma(start, policy, pages, psize, anon, fname, kind))
    return out


def task_policy_token(vmas: Iterable[Vma]) -> str | None:
    """The thread's own policy per the module rule (None when there are no VMAs)."""
    vmas = list(vmas)
    ordinary = [v.policy for v in vmas if not v.special] or [v.policy for v in vmas]
    if not ordinary:
        return None
    return Counter(ordinary).most_common(1)[0][0]


# -------------------------------------------------------------------- reading


def _read(path: str, limit: int | None = None) -> str:
    """A /proc file's text (its first ``limit`` bytes, whole lines only): plain ``os`` calls, no file
    object (open/read/close, not the seven syscalls and two objects of ``open()``: the re-checks read
    a few of these per worker and second)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        got = 0
        while limit is None or got < limit:
            b = os.read(fd, 65536 if limit is None else min(65536, limit - got))
            if not b:
                break
            chunks.append(b)
            got += len(b)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if limit is not None and len(data) >= limit:  # drop the partial last line
        data = data[: data.rfind(b"\n") + 1]
    return data.decode("utf-8", "replace")


def read_numa_maps(pid: int, tid: int | None = None, proc_root: str = "/proc") -> list[Vma]:
    """Parsed ``/proc/PID/numa_maps`` (or one thread's ``task/TID/numa_maps``)."""
    base = os.path.join(proc_root, str(pid)) if tid is None else os.path.join(proc_root, str(pid), "task", str(tid))
    return parse_numa_maps(_read(os.path.join(base, "numa_maps")))


def _status_fields(text: str, keys: tuple[str, ...] | None = None) -> dict[str, str]:
    """``status`` lines as a dict; with ``keys``, only those fields (found without splitting every line)."""
    out = {}
    if keys is not None:
        for key in keys:
            i = text.find("\n" + key + ":")
            if i < 0 and not text.startswith(key + ":"):
                continue
            start = (i + 1 if i >= 0 else 0) + len(key) + 1
            end = text.find("\n", start)
            out[key] = text[start:end if end >= 0 else len(text)].strip()
        return out
    for line in text.splitlines():
        k, sep, v = line.partition(":")
        if sep:
            out[k.strip()] = v.strip()
    return out


#: The ``status`` fields a placement check uses.
_STATUS_KEYS = ("Name", "State", "Cpus_allowed_list", "Mems_allowed_list")


_GONE = (errno.ENOENT, errno.ESRCH)


def _thread_status(tdir: str) -> dict[str, str] | None:
    """A thread's ``status`` fields; None when it is gone or exiting (nothing to judge)."""
    try:
        st = _status_fields(_read(os.path.join(tdir, "status")), _STATUS_KEYS)
    except OSError as e:
        if e.errno in _GONE:
            return None
        raise
    if st.get("State", "").startswith(("Z", "X")):
        return None  # exiting: its mm is gone, nothing to judge
    return st


_EMPTY = object()  # the thread's numa_maps was empty or gone: exiting (or a kernel thread)


def _thread_policy(tdir: str, sample_bytes: int | None) -> "tuple[str | None, str | None] | object":
    """(policy token, error) from the head of a thread's numa_maps; ``_EMPTY`` when there is none."""
    try:
        policy = task_policy_token(parse_numa_maps(_read(os.path.join(tdir, "numa_maps"), sample_bytes)))
    except OSError as e:
        if e.errno in _GONE:
            return _EMPTY
        return (None, e.strerror or str(e))
    return _EMPTY if policy is None else (policy, None)


def _list_tids(pdir: str, pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(os.path.join(pdir, "task")) if t.isdigit())
    except FileNotFoundError:
        raise ProcessLookupError(errno.ESRCH, f"process {pid} is gone") from None


def _thread(tid: int, st: dict[str, str], policy: str | None, perr: str | None,
            cpus: tuple[int, ...] | None = None) -> ThreadPlacement:
    if cpus is None:
        cpus = parse_list(st.get("Cpus_allowed_list", ""))
    mems = parse_list(st["Mems_allowed_list"]) if "Mems_allowed_list" in st else None
    return ThreadPlacement(tid, st.get("Name", "?"), cpus, policy, mems, perr)


#: VMA kinds of a process's own anonymous memory (no file behind them): what it allocated itself.
ANON_KINDS = frozenset({"heap", "stack", "anon", "huge"})


def read_node_pages(pid: int, proc_root: str = "/proc", *,
                    anon_only: bool = False) -> tuple[dict[int, int], dict[int, int]]:
    """(pages, bytes) per node over the whole ``/proc/PID/numa_maps`` ({} when unreadable).

    ``anon_only``: only VMAs without a file (heap, stack, anonymous mappings,
    anonymous huge pages): the memory the process allocated, not the shared
    libraries and page cache it maps, which sit wherever they were first read.
    The most expensive read here (the kernel walks every VMA's page tables):
    callers that re-check often refresh it rarely (``PlacementReader``).
    """
    pages: dict[int, int] = {}
    nbytes: dict[int, int] = {}
    try:
        for v in parse_numa_maps(_read(os.path.join(proc_root, str(pid), "numa_maps"))):
            if anon_only and (v.file is not None or v.kind not in ANON_KINDS):
                continue
            for n, c in v.pages.items():
                pages[n] = pages.get(n, 0) + c
                nbytes[n] = nbytes.get(n, 0) + c * v.page_size_kb * 1024
    except OSError as e:
        if e.errno not in _GONE + (errno.EACCES, errno.EPERM):
            raise
    return pages, nbytes


def read_placement(pid: int, proc_root: str = "/proc", *, policy_sample_bytes: int | None = 65536) -> ObservedPlacement:
    """Every thread's CPUs and memory policy, and the process's pages per node.

    Threads that exit while we read are left out.  Raises ProcessLookupError
    when the process itself is gone.
    """
    pdir = os.path.join(proc_root, str(pid))
    threads = []
    for tid in _list_tids(pdir, pid):
        tdir = os.path.join(pdir, "task", str(tid))
        st = _thread_status(tdir)
        if st is None:
            continue
        got = _thread_policy(tdir, policy_sample_bytes)
        if got is _EMPTY:
            continue
        policy, perr = got  # type: ignore[misc]
        threads.append(_thread(tid, st, policy, perr))
    if not threads and not os.path.isdir(pdir):
        raise ProcessLookupError(errno.ESRCH, f"process {pid} is gone")
    pages, nbytes = read_node_pages(pid, proc_root)
    return ObservedPlacement(pid, tuple(threads), pages, nbytes)


@dataclass
class _Known:
    """What a ``PlacementReader`` remembers of one process between checks."""

    policies: dict[int, tuple[str | None, str | None]] = field(default_factory=dict)
    status: dict[int, dict[str, str]] = field(default_factory=dict)           # tid -> its last ``status`` read
    placed: dict[int, tuple[tuple[int, ...], str | None]] = field(default_factory=dict)   # tid -> (CPUs, mems)
    pages: dict[int, int] = field(default_factory=dict)
    nbytes: dict[int, int] = field(default_factory=dict)
    checks: int = 0
    turn: int = 0
    since_policy: int = 0      # checks since a known thread's policy was last re-read


class PlacementReader:
    """Re-checks of the same processes at a fraction of ``read_placement``'s cost.

    Why: reading a thread's ``numa_maps`` makes the kernel walk page tables
    (~0.4 ms per thread at 8 KB, ~1.7 ms for a worker's whole file) and its
    parse is most of the rest, and the supervisor re-checks every worker every
    ``verify_interval``.  What anything *outside* the process can change is
    read every check, cheaply: the thread list and each thread's CPUs
    (``taskset``, a cgroup's cpuset: ``sched_getaffinity``, a syscall, on the
    live /proc; a thread's ``status`` costs ~50 µs for the kernel to print);
    a thread's whole ``status`` (name, state, cpuset mems, which remap a
    policy without static node ids) is read when the thread is new and every
    ``policy_every``-th check.  A memory policy can only be changed by the
    process itself (``set_mempolicy`` acts on the calling thread, ``mbind`` on
    the caller's own memory), so policies are sampled: a thread's policy is
    read when the thread is first seen (a thread an app starts unbound shows
    up on the next check), and of the threads already known one (in turn) has
    its policy read again on a check where a thread came or went or its CPUs
    or mems changed, else on every ``policy_every``-th check: a policy the
    worker's own code changed later is found within ``policy_every`` × its
    threads checks.  The process's pages per node (the remote share) are read
    on the first check and then every ``pages_every`` checks.  Unreadable
    policies are retried every check.
    """

    def __init__(self, proc_root: str = "/proc", *, first_sample_bytes: int | None = 65536,
                 sample_bytes: int | None = 8192, pages_every: int = 10, policy_every: int = 3) -> None:
        self.proc_root = proc_root
        self.first_sample_bytes = first_sample_bytes
        self.sample_bytes = sample_bytes
        self.pages_every = max(1, pages_every)
        self.policy_every = max(1, policy_every)
        self._live = os.path.realpath(proc_root) == "/proc"   # tids are this system's: syscalls may ask them
        self._known: dict[int, _Known] = {}
        self.policy_reads = 0      # numa_maps reads done (for tests and benchmarks)
        self.status_reads = 0      # thread ``status`` reads done
        self.pages_reads = 0

    def forget(self, keep: Iterable[int]) -> None:
        """Drop what is remembered of every pid not in ``keep`` (exited workers)."""
        live = set(keep)
        for pid in [p for p in self._known if p not in live]:
            del self._known[pid]

    def read(self, pid: int, *, fresh: bool = False) -> ObservedPlacement:
        """Like ``read_placement(pid)``; raises ProcessLookupError when the process is gone.

        ``fresh``: forget what is known of ``pid`` first (a new process, maybe a reused pid).
        """
        known = None if fresh else self._known.get(pid)
        first = known is None
        if known is None:
            known = self._known[pid] = _Known()
        pdir = os.path.join(self.proc_root, str(pid))
        full = first or known.since_policy + 1 >= self.policy_every   # every status read in full on this check
        status: dict[int, dict[str, str]] = {}
        cpus: dict[int, tuple[int, ...]] = {}
        for tid in _list_tids(pdir, pid):
            st = None if full else known.status.get(tid)
            if st is not None and self._live:
                try:
                    cpus[tid] = tuple(sorted(os.sched_getaffinity(tid)))
                except OSError:   # gone (ESRCH) or not ours to read: read its status instead
                    st = None
            if st is None or tid not in cpus:
                self.status_reads += 1
                st = _thread_status(os.path.join(pdir, "task", str(tid)))
                if st is None:
                    continue
                cpus[tid] = parse_list(st.get("Cpus_allowed_list", ""))
            status[tid] = st
        placed = {tid: (cpus[tid], st.get("Mems_allowed_list")) for tid, st in status.items()}
        old = [t for t in status if t in known.policies and known.policies[t][0] is not None]
        again = None
        if old and not first and (placed != known.placed or known.since_policy + 1 >= self.policy_every):
            again = old[known.turn % len(old)]
            known.turn += 1
        known.since_policy = 0 if again is not None else known.since_policy + 1
        threads = []
        seen: dict[int, tuple[str | None, str | None]] = {}
        for tid, st in status.items():
            got: object = known.policies.get(tid)
            if got is None or got[0] is None or tid == again:  # type: ignore[index]
                self.policy_reads += 1
                got = _thread_policy(os.path.join(pdir, "task", str(tid)),
                                     self.first_sample_bytes if first else self.sample_bytes)
                if got is _EMPTY:
                    placed.pop(tid, None)
                    continue
            policy, perr = got  # type: ignore[misc]
            seen[tid] = (policy, perr)
            threads.append(_thread(tid, st, policy, perr, cpus[tid]))
        known.policies = seen   # threads that exited are forgotten
        known.status = {tid: status[tid] for tid in seen}
        known.placed = placed
        if not threads and not os.path.isdir(pdir):
            del self._known[pid]
            raise ProcessLookupError(errno.ESRCH, f"process {pid} is gone")
        if known.checks % self.pages_every == 0:
            self.pages_reads += 1
            known.pages, known.nbytes = read_node_pages(pid, self.proc_root)
        known.checks += 1
        return ObservedPlacement(pid, tuple(threads), dict(known.pages), dict(known.nbytes))


# ------------------------------------------------------------------- judging


def _norm_mode(mempolicy: str) -> str:
    m = mempolicy.strip().lower().replace("-", "_")
    return _ALIASES.get(m, m)


def expected_policy(mempolicy: str, nodes: Iterable[int], *, static: bool = True) -> MemPolicy:
    """The policy numaserve sets for ``mempolicy`` over ``nodes`` (static node ids)."""
    mode = _norm_mode(mempolicy)
    if mode in ("local", "default"):
        return MemPolicy(mode)
    return MemPolicy(mode, tuple(nodes), static=static)


def policy_matches(token: str, mempolicy: str, nodes: Iterable[int]) -> bool:
    """Equivalence used by checks: same mode and node set; static-ness ignored;
    ``local`` and ``default`` are the same thing."""
    try:
        got = parse_numa_maps_token(token)
    except ValueError:
        return False
    want = _norm_mode(mempolicy)
    if want in ("local", "default"):
        return got.mode in ("local", "default")
    return got.mode == want and set(got.nodes) == set(nodes)


def _who(t: ThreadPlacement) -> str:
    return f"thread {t.tid} ({t.name})"


def check_placement(
    observed: ObservedPlacement,
    *,
    cpus: Iterable[int],
    mempolicy: str,
    nodes: Iterable[int],
    require_static: bool = False,
) -> tuple[bool, list[str]]:
    """Compare every thread with the intended placement; (ok, mismatch lines).

    A thread's CPUs must be a non-empty subset of ``cpus`` (an app may pin its
    own threads tighter, never wider).  Policies compare by ``policy_matches``;
    with ``require_static`` a non-static policy is a mismatch too (otherwise
    see ``policy_notes``).  Threads that vanished are not in ``observed``.
    """
    want_cpus = set(cpus)
    node_list = sorted(set(nodes))
    want_token = expected_policy(mempolicy, node_list).token()
    problems: list[str] = []
    for t in observed.threads:
        if not t.cpus or not set(t.cpus) <= want_cpus:
            problems.append(f"{_who(t)} runs on {format_list(t.cpus) or 'no CPU'}, expected {format_list(want_cpus)}")
    bad: dict[str, list[ThreadPlacement]] = {}
    for t in observed.threads:
        if t.policy is None:
            problems.append(f"{_who(t)} memory policy unreadable: {t.policy_error or 'unknown'}")
            continue
        ok = policy_matches(t.policy, mempolicy, node_list)
        if ok and require_static and _norm_mode(mempolicy) not in ("local", "default"):
            ok = parse_numa_maps_token(t.policy).static
        if not ok:
            bad.setdefault(t.policy, []).append(t)
    readable = [t for t in observed.threads if t.policy is not None]
    for token, ts in bad.items():
        if len(ts) == len(readable) and len(bad) == 1:
            problems.append(f"policy {token}, expected {want_token}")
        else:
            problems.extend(f"{_who(t)} policy {token}, expected {want_token}" for t in ts)
    if not observed.threads:
        problems.append(f"process {observed.pid}: no thread could be read")
    return (not problems, problems)


def policy_notes(observed: ObservedPlacement) -> list[str]:
    """Informational lines: policies set without static node ids (e.g. by numactl)."""
    notes = []
    for token, tids in observed.policies().items():
        if token is None:
            continue
        try:
            p = parse_numa_maps_token(token)
        except ValueError:
            notes.append(f"unknown policy token {token!r} on {len(tids)} thread(s)")
            continue
        if p.nodes and not p.static:
            notes.append(
                f"policy {token} on {len(tids)} thread(s) has no static flag: "
                "a cpuset change would remap its nodes (numactl never sets it)"
            )
    return notes


def check_self(
    cpus: Iterable[int], mempolicy: str, nodes: Iterable[int]
) -> tuple[bool, list[str], tuple[int, ...], str]:
    """A worker's own check at start (calling thread): (ok, problems, cpus, policy token)."""
    want_cpus = set(cpus)
    node_list = sorted(set(nodes))
    problems: list[str] = []
    have_cpus = get_cpu_affinity()
    if not set(have_cpus) <= want_cpus:
        problems.append(f"runs on {format_list(have_cpus)}, expected {format_list(want_cpus)}")
    try:
        token = get_mempolicy().token()
    except OSError as e:
        return (False, problems + [f"cannot read memory policy: {e.strerror or e}"], have_cpus, "unknown")
    if not policy_matches(token, mempolicy, node_list):
        problems.append(f"policy {token}, expected {expected_policy(mempolicy, node_list).token()}")
    return (not problems, problems, have_cpus, token)
