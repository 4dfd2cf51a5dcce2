"""Which CPUs and memory nodes this process may use: affinity ∩ cgroup cpuset.

systemd ``AllowedCPUs=``, Docker ``--cpuset-cpus`` and the Kubernetes CPU
manager narrow the machine through the cgroup cpuset; ``taskset``/``numactl``
through the affinity mask.  A worker bound outside either gets ``EINVAL``, so
placement starts from their intersection (FACTS §3.1, §8.3).

On this machine the affinity is ``os.sched_getaffinity(0)``; on a dump it is
the dump's ``proc/self/status`` ``Cpus_allowed_list`` (all online CPUs when
absent).  The cpuset comes from ``proc/self/cgroup``:

* v1 (``N:cpuset:/path``): ``sys/fs/cgroup/cpuset/<path>/cpuset.effective_cpus``
  (else ``cpuset.cpus``) and ``cpuset.effective_mems`` (else ``cpuset.mems``);
* v2 (``0::/path``): ``sys/fs/cgroup/<path>/cpuset.cpus.effective`` and
  ``cpuset.mems.effective`` (also under ``sys/fs/cgroup/unified`` on hybrid
  hosts).

Both walk up to the nearest ancestor that has the file: the root cgroup, and
cgroups without the cpuset controller, may not have it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from numaserve.cpulist import ListSyntaxError, parse_list, parse_mask
from numaserve.topology.sysfs import Root, Unknowns

__all__ = ["Cgroup", "read_cgroup", "read_affinity", "read_status_mems", "parse_proc_cgroup"]

_V1_FILES = {"cpus": ("cpuset.effective_cpus", "cpuset.cpus"), "mems": ("cpuset.effective_mems", "cpuset.mems")}
_V2_FILES = {"cpus": ("cpuset.cpus.effective",), "mems": ("cpuset.mems.effective",)}


@dataclass
class Cgroup:
    """The cgroup cpuset bound: ``None`` sets mean "does not narrow"."""

    version: int | None = None
    path: str | None = None
    cpus: tuple[int, ...] | None = None
    mems: tuple[int, ...] | None = None
    cpus_file: str | None = None
    mems_file: str | None = None


def parse_proc_cgroup(text: str) -> tuple[str | None, str | None]:
    """``proc/self/cgroup`` → (v1 cpuset path, v2 path); ``None`` when that line is absent."""
    v1: str | None = None
    v2: str | None = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path or "/"
        elif "cpuset" in controllers.split(","):
            v1 = path or "/"
    return v1, v2


def _ancestors(path: str) -> list[str]:
    """"/a/b" → ["a/b", "a", ""] (relative, deepest first)."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _find_set(
    fs: Root, bases: list[str], path: str, names: tuple[str, ...], what: str, unknowns: Unknowns
) -> tuple[tuple[int, ...] | None, str | None]:
    for anc in _ancestors(path):
        for base in bases:
            d = f"{base}/{anc}".rstrip("/")
            for name in names:
                rel = f"{d}/{name}"
                text = fs.read(rel)
                if text is None:
                    continue
                try:
                    vals = parse_list(text)
                except ListSyntaxError as e:
                    unknowns.add(what, f"{rel}: {e}; not narrowed by the cgroup")
                    return None, rel
                if not vals:
                    # v1 children may leave cpuset.cpus empty until set; the effective file wins
                    continue
                return vals, rel
    return None, None


def _version(fs: Root, v1: str | None, v2: str | None) -> int | None:
    if fs.exists("sys/fs/cgroup/cgroup.controllers"):
        return 2
    if v1 is not None or fs.is_dir("sys/fs/cgroup/cpuset"):
        return 1
    if v2 is not None:
        return 2
    return None


def read_cgroup(fs: Root, unknowns: Unknowns) -> Cgroup:
    """The cgroup version and the cpuset's effective CPUs and memory nodes."""
    text = fs.read("proc/self/cgroup")
    if text is None:
        version = _version(fs, None, None)
        unknowns.add("cgroup cpuset", "proc/self/cgroup: missing; CPUs and memory nodes not narrowed by a cgroup")
        if version is None:
            unknowns.add("cgroup version", "no proc/self/cgroup and no sys/fs/cgroup hierarchy")
        return Cgroup(version=version)
    v1, v2 = parse_proc_cgroup(text)
    version = _version(fs, v1, v2)
    if version is None:
        unknowns.add("cgroup version", "proc/self/cgroup has no cpuset or unified line")
    if v1 is not None:
        bases = ["sys/fs/cgroup/cpuset", "sys/fs/cgroup/cpuset,cpu", "sys/fs/cgroup/cpu,cpuset"]
        path, files = v1, _V1_FILES
    elif v2 is not None:
        bases = ["sys/fs/cgroup", "sys/fs/cgroup/unified"]
        path, files = v2, _V2_FILES
    else:
        return Cgroup(version=version)
    cpus, cpus_file = _find_set(fs, bases, path, files["cpus"], "cgroup cpuset cpus", unknowns)
    mems, mems_file = _find_set(fs, bases, path, files["mems"], "cgroup cpuset mems", unknowns)
    if v1 is not None and cpus_file is None:
        unknowns.add(
            "cgroup cpuset cpus",
            f"proc/self/cgroup names cpuset {v1} but no {'/'.join(files['cpus'])} under "
            f"{bases[0]}{v1.rstrip('/')} or its parents",
        )
    return Cgroup(version=version, path=path, cpus=cpus, mems=mems, cpus_file=cpus_file, mems_file=mems_file)


def _status_field(fs: Root, list_key: str, mask_key: str, what: str, unknowns: Unknowns) -> tuple[int, ...] | None:
    text = fs.read("proc/self/status")
    if text is None:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        k, sep, v = line.partition(":")
        if sep:
            fields[k.strip()] = v.strip()
    for key, parse in ((list_key, parse_list), (mask_key, parse_mask)):
        if key in fields:
            try:
                vals = parse(fields[key])
            except ListSyntaxError as e:
                unknowns.add(what, f"proc/self/status {key}: {e}")
                return None
            if vals:
                return vals
            unknowns.add(what, f"proc/self/status {key}: empty")
            return None
    return None


def read_affinity(fs: Root, unknowns: Unknowns) -> tuple[int, ...] | None:
    """This process's CPU affinity: ``sched_getaffinity`` on "/", the dump's status otherwise."""
    if fs.is_host:
        return tuple(sorted(os.sched_getaffinity(0)))
    return _status_field(fs, "Cpus_allowed_list", "Cpus_allowed", "cpu affinity", unknowns)


def read_status_mems(fs: Root, unknowns: Unknowns) -> tuple[int, ...] | None:
    """``Mems_allowed_list`` of ``proc/self/status`` (the cpuset's nodes), ``None`` when absent."""
    return _status_field(fs, "Mems_allowed_list", "Mems_allowed", "mems allowed", unknowns)
