"""Host facts later checks depend on: kernel, irqbalance, sysctls, THP.

* kernel: the listener-migration and IRQ ``EPERM`` fixes depend on it (FACTS §5.2, §7.7);
* irqbalance: it rewrites IRQ affinities every 10 s (FACTS §5.4);
* ``kernel.numa_balancing`` migrates pages, ``net.ipv4.tcp_migrate_req``
  keeps queued connections when a listener closes, ``net.core.somaxconn``
  caps the backlog, ``net.ipv4.tcp_tw_reuse`` matters for proxies;
* THP mode changes RSS growth patterns the leak detector sees.

The cgroup version is read by ``allowed.read_cgroup`` and filled in by ``discover``.
"""

from __future__ import annotations

import re

from numaserve.topology.model import SystemInfo
from numaserve.topology.sysfs import Root, Unknowns

__all__ = ["SYSCTLS", "discover_system", "read_kernel", "read_irqbalance", "read_sysctl", "read_thp", "read_thp_defrag"]

SYSCTLS = ("kernel.numa_balancing", "net.ipv4.tcp_migrate_req", "net.core.somaxconn", "net.ipv4.tcp_tw_reuse")
_VERSION_RE = re.compile(r"^Linux version (\S+)")
_THP_RE = re.compile(r"\[(\w+)\]")


def read_kernel(fs: Root, unknowns: Unknowns) -> str | None:
    """``proc/sys/kernel/osrelease``, else the release in ``proc/version``."""
    text = (fs.read("proc/sys/kernel/osrelease") or "").strip()
    if text:
        return text
    m = _VERSION_RE.match((fs.read("proc/version") or "").strip())
    if m:
        return m.group(1)
    unknowns.add("kernel", "proc/sys/kernel/osrelease and proc/version: missing or unreadable")
    return None


def read_irqbalance(fs: Root, unknowns: Unknowns) -> tuple[bool | None, tuple[int, ...]]:
    """(running, pids) from ``proc/<pid>/comm``; (None, ()) when there is no process list."""
    pids = [int(e) for e in fs.listdir("proc") if e.isdigit()]
    if not pids:
        unknowns.add("irqbalance", "no proc/<pid> directories to look at")
        return None, ()
    found = tuple(sorted(p for p in pids if (fs.read(f"proc/{p}/comm") or "").strip() == "irqbalance"))
    return bool(found), found


def read_sysctl(fs: Root, name: str, unknowns: Unknowns) -> int | str | None:
    """One sysctl from ``proc/sys``: an int when it is one, else the text; ``None`` when missing."""
    rel = "proc/sys/" + name.replace(".", "/")
    text = fs.read(rel)
    if text is None or not text.strip():
        unknowns.add(f"sysctl {name}", f"{rel}: {'missing' if text is None else 'empty'}")
        return None
    s = text.strip()
    try:
        return int(s)
    except ValueError:
        return s


def read_thp(fs: Root, unknowns: Unknowns) -> str | None:
    """The bracketed word of ``transparent_hugepage/enabled`` ("always [madvise] never" → "madvise")."""
    rel = "sys/kernel/mm/transparent_hugepage/enabled"
    text = fs.read(rel)
    m = _THP_RE.search(text or "")
    if m:
        return m.group(1)
    unknowns.add("thp", f"{rel}: {'missing' if text is None else 'no [selected] mode'}")
    return None


def read_thp_defrag(fs: Root) -> tuple[str | None, int | None]:
    """(``transparent_hugepage/defrag`` selected mode, ``khugepaged/defrag`` 0/1); None when unread.

    Not recorded as unknown: kernels without THP have neither file, and
    nothing then works against a binding.
    """
    base = "sys/kernel/mm/transparent_hugepage"
    m = _THP_RE.search(fs.read(f"{base}/defrag") or "")
    text = (fs.read(f"{base}/khugepaged/defrag") or "").strip()
    return (m.group(1) if m else None), (int(text) if text.isdigit() else None)


def discover_system(fs: Root, unknowns: Unknowns, cgroup_version: int | None = None) -> SystemInfo:
    running, pids = read_irqbalance(fs, unknowns)
    defrag, khugepaged_defrag = read_thp_defrag(fs)
    return SystemInfo(
        kernel=read_kernel(fs, unknowns),
        irqbalance_running=running,
        irqbalance_pids=pids,
        sysctls={name: read_sysctl(fs, name, unknowns) for name in SYSCTLS},
        thp=read_thp(fs, unknowns),
        cgroup_version=cgroup_version,
        thp_defrag=defrag,
        thp_khugepaged_defrag=khugepaged_defrag,
    )
