"""Per-CPU facts behind placement decisions: offline, isolated, socket, L3 group.

Why: ``numaserve plan --explain`` and ``doctor`` must say why a CPU gets no
worker (offline, ``isolcpus``) and what works against a binding (several
nodes in one socket); ``slots = "l3"`` groups CPUs by the last-level cache
they share (AMD CCX/CCD).  Everything comes from ``sys/devices/system/cpu``
and ``proc/cmdline`` under a ``Root``, so dumps and test trees read the same.
"""

from __future__ import annotations

import re

from numaserve.cpulist import ListSyntaxError, parse_list
from numaserve.topology.cpus import CPU_DIR
from numaserve.topology.model import CpuFacts
from numaserve.topology.sysfs import Root, Unknowns, read_cpus, read_int, read_list

__all__ = ["read_cpu_facts", "cmdline_cpus", "l3_groups"]

_INDEX_RE = re.compile(r"^index\d+$")


def cmdline_cpus(cmdline: str, param: str) -> tuple[int, ...]:
    """CPUs named by ``param=`` on a kernel command line (last one wins).

    ``isolcpus=`` may start with flags (``isolcpus=nohz,domain,managed_irq,2-5``):
    only the trailing CPU list counts.  Garbage gives ``()``.
    """
    found: tuple[int, ...] = ()
    for word in cmdline.split():
        if word == "--":
            break  # the rest belongs to init
        key, sep, value = word.partition("=")
        if not sep or key != param:
            continue
        parts = value.split(",")
        while parts and parts[0] and not parts[0][0].isdigit():
            parts.pop(0)  # isolcpus flags
        try:
            found = parse_list(",".join(parts)) if parts else ()
        except ListSyntaxError:
            found = ()
    return found


def l3_groups(fs: Root, cpus: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    """CPU → the CPUs sharing its level-3 cache (``cache/index*/level`` = 3,
    ``shared_cpu_list``); CPUs without an L3 entry are left out."""
    out: dict[int, tuple[int, ...]] = {}
    for c in cpus:
        base = f"{CPU_DIR}/cpu{c}/cache"
        for idx in fs.listdir(base):
            if not _INDEX_RE.match(idx) or read_int(fs, f"{base}/{idx}/level") != 3:
                continue
            shared = read_cpus(fs, f"{base}/{idx}/shared_cpu_list", f"{base}/{idx}/shared_cpu_map", "", None)
            if shared:
                out[c] = tuple(sorted(set(shared) | {c}))
                break
    return out


def read_cpu_facts(fs: Root, online: tuple[int, ...], unknowns: Unknowns) -> CpuFacts:
    """Offline, isolated and nohz_full CPUs, each CPU's socket and L3 group."""
    present = read_list(fs, f"{CPU_DIR}/present")
    online_set = set(online)
    offline = tuple(c for c in present if c not in online_set) if present is not None else ()
    cmdline = fs.read("proc/cmdline") or ""
    isolated = set(read_list(fs, f"{CPU_DIR}/isolated") or ()) | set(cmdline_cpus(cmdline, "isolcpus"))
    nohz = set(read_list(fs, f"{CPU_DIR}/nohz_full") or ()) | set(cmdline_cpus(cmdline, "nohz_full"))
    packages: dict[int, int] = {}
    missing = 0
    for c in online:
        pkg = read_int(fs, f"{CPU_DIR}/cpu{c}/topology/physical_package_id")
        if pkg is None or pkg < 0:
            missing += 1
        else:
            packages[c] = pkg
    if missing and online:
        unknowns.add("cpu packages", f"{CPU_DIR}/cpuN/topology/physical_package_id unreadable for {missing} CPU(s)")
    return CpuFacts(
        offline=offline,
        isolated=tuple(sorted(isolated)),
        nohz_full=tuple(sorted(nohz)),
        packages=packages,
        l3=l3_groups(fs, online),
    )
