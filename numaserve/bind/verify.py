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
    with open(path, "rb") as f:
        if limit is None:
            data = f.read()
        else:
            data = f.read(limit)
            if len(data) >= limit:  # drop the partial last line
                data = data[: data.rfind(b"\n") + 1]
    return data.decode("utf-8", "replace")


def read_numa_maps(pid: int, tid: int | None = None, proc_root: str = "/proc") -> list[Vma]:
    """Parsed ``/proc/PID/numa_maps`` (or one thread's ``task/TID/numa_maps``)."""
    base = os.path.join(proc_root, str(pid)) if tid is None else os.path.join(proc_root, str(pid), "task", str(tid))
    return parse_numa_maps(_read(os.path.join(base, "numa_maps")))


def _status_fields(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        k, sep, v = line.partition(":")
        if sep:
            out[k.strip()] = v.strip()
    return out


_GONE = (errno.ENOENT, errno.ESRCH)


def read_placement(pid: int, proc_root: str = "/proc", *, policy_sample_bytes: int | None = 65536) -> ObservedPlacement:
    """Every thread's CPUs and memory policy, and the process's pages per node.

    Threads that exit while we read are left out.  Raises ProcessLookupError
    when the process itself is gone.
    """
    pdir = os.path.join(proc_root, str(pid))
    try:
        tids = sorted(int(t) for t in os.listdir(os.path.join(pdir, "task")) if t.isdigit())
    except FileNotFoundError:
        raise ProcessLookupError(errno.ESRCH, f"process {pid} is gone") from None
    threads = []
    for tid in tids:
        tdir = os.path.join(pdir, "task", str(tid))
        try:
            st = _status_fields(_read(os.path.join(tdir, "status")))
        except OSError as e:
            if e.errno in _GONE:
                continue
            raise
        if st.get("State", "").startswith(("Z", "X")):
            continue  # exiting: its mm is gone, nothing to judge
        cpus = parse_list(st.get("Cpus_allowed_list", ""))
        mems = parse_list(st["Mems_allowed_list"]) if "Mems_allowed_list" in st else None
        policy: str | None = None
        perr: str | None = None
        try:
            vmas = parse_numa_maps(_read(os.path.join(tdir, "numa_maps"), policy_sample_bytes))
            policy = task_policy_token(vmas)
            if policy is None:
                continue  # empty numa_maps: the thread is exiting (or a kernel thread)
        except OSError as e:
            if e.errno in _GONE:
                continue
            perr = e.strerror or str(e)
        threads.append(ThreadPlacement(tid, st.get("Name", "?"), cpus, policy, mems, perr))
    if not threads and not os.path.isdir(pdir):
        raise ProcessLookupError(errno.ESRCH, f"process {pid} is gone")
    pages: dict[int, int] = {}
    nbytes: dict[int, int] = {}
    try:
        for v in parse_numa_maps(_read(os.path.join(pdir, "numa_maps"))):
            for n, c in v.pages.items():
                pages[n] = pages.get(n, 0) + c
                nbytes[n] = nbytes.get(n, 0) + c * v.page_size_kb * 1024
    except OSError as e:
        if e.errno not in _GONE + (errno.EACCES, errno.EPERM):
            raise
    return ObservedPlacement(pid, tuple(threads), pages, nbytes)


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
