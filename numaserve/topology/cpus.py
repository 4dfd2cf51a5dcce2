"""Online CPUs and SMT siblings from ``sys/devices/system/cpu``.

Placement puts one worker's threads on real cores before SMT siblings, and
never on an offline CPU, so both come from the kernel's own lists, not from
``_SC_NPROCESSORS_ONLN`` (which ignores offline holes and cpusets).
"""

from __future__ import annotations

import re

from numaserve.cpulist import ListSyntaxError, format_list, parse_list
from numaserve.topology.sysfs import Root, Unknowns, read_cpus

__all__ = ["online_cpus", "smt_siblings", "CPU_DIR"]

CPU_DIR = "sys/devices/system/cpu"
_CPU_RE = re.compile(r"^cpu(\d+)$")


def _cpu_dirs(fs: Root) -> list[int]:
    return sorted(int(m.group(1)) for e in fs.listdir(CPU_DIR) if (m := _CPU_RE.match(e)))


def online_cpus(fs: Root, unknowns: Unknowns) -> tuple[int, ...] | None:
    """``cpu/online``; else the ``cpuN`` dirs whose ``online`` is not 0; else ``None``.

    cpu0 often has no ``online`` file (it cannot be unplugged): absent = online.
    """
    text = fs.read(f"{CPU_DIR}/online")
    if text is not None:
        try:
            cpus = parse_list(text)
            if cpus:
                return cpus
            reason = f"{CPU_DIR}/online: empty"
        except ListSyntaxError as e:
            reason = f"{CPU_DIR}/online: {e}"
    else:
        reason = f"{CPU_DIR}/online: missing"
    dirs = _cpu_dirs(fs)
    if dirs:
        unknowns.add("online cpus", f"{reason}; using the cpuN directories")
        return tuple(c for c in dirs if (fs.read(f"{CPU_DIR}/cpu{c}/online") or "1").strip() != "0")
    unknowns.add("online cpus", f"{reason}; no cpuN directories either")
    return None


def smt_siblings(fs: Root, cpus: tuple[int, ...], unknowns: Unknowns) -> dict[int, tuple[int, ...]]:
    """CPU → its hardware threads (itself included), from ``thread_siblings_list``
    (else ``core_cpus_list``, else the ``thread_siblings`` mask).  CPUs with no
    readable topology are left out and counted in one ``Unknown``."""
    out: dict[int, tuple[int, ...]] = {}
    missing: list[int] = []
    for c in cpus:
        base = f"{CPU_DIR}/cpu{c}/topology"
        sib = read_cpus(fs, f"{base}/thread_siblings_list", None, "", None)
        if sib is None:
            sib = read_cpus(fs, f"{base}/core_cpus_list", f"{base}/thread_siblings", "", None)
        if not sib:
            missing.append(c)
            continue
        out[c] = tuple(sorted(set(sib) | {c}))
    if missing:
        unknowns.add(
            "smt siblings",
            f"{CPU_DIR}/cpuN/topology/thread_siblings_list unreadable for CPUs {format_list(missing)}",
        )
    return out
