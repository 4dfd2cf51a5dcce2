"""``/proc/interrupts`` names and per-IRQ affinity; queue vs admin classification.

Which IRQs belong to a NIC comes from sysfs (``msi_irqs/``, FACTS §4); this
module only names them and says which are per-queue vectors (steered one per
CPU) and which are admin vectors (config, async, misc: left alone).  Names
follow the drivers (FACTS §4.1):

=========  ============================================  ==================
driver     queue vector                                  admin vector
=========  ============================================  ==================
mlx5       ``mlx5_comp<N>@pci:<BDF>``                    ``mlx5_async<N>@pci:<BDF>`` (any other ``mlx5_*``)
mlx4       ``mlx4-<N>@<BDF>``                            ``mlx4-async@<BDF>``
igb/ixgbe  ``<if>-TxRx-<n>``, ``<if>-rx-<n>``, ``-tx-``  ``<if>``
i40e/ice   ``i40e-<if>-TxRx-<n>``, ``ice-<if>-TxRx-<n>``  ``i40e-<BDF>:misc``, ``ice-...:misc``, ``*fdir*``
iavf       ``iavf-<if>-TxRx-<n>``                        ``iavf-<BDF>:mbx``
virtio     ``virtioN-input.<q>``, ``virtioN-output.<q>``  ``virtioN-config``
ena        ``<if>-Tx-Rx-<n>``                            ``ena-mgmnt@pci:<BDF>``
=========  ============================================  ==================

Anything else is "unknown": never steered blindly.
"""

from __future__ import annotations

import re

from numaserve.topology.model import IrqKind
from numaserve.topology.sysfs import Root, read_cpus

__all__ = ["parse_interrupts", "classify_irq", "irq_affinity", "irq_name_from_proc_dir"]

_TRIGGER_RE = re.compile(r"^(\d+-)?(edge|level|fasteoi|simple|eoi|none)$", re.IGNORECASE)

_PATTERNS: list[tuple[re.Pattern[str], IrqKind]] = [
    (re.compile(r"^mlx5_comp(?P<q>\d+)(@.*)?$"), "queue"),
    (re.compile(r"^mlx5_"), "admin"),
    (re.compile(r"^mlx4-(?P<q>\d+)(@.*)?$"), "queue"),
    (re.compile(r"^mlx4-async"), "admin"),
    (re.compile(r"^(i40e|ice|iecm|iavf)-.*fdir", re.IGNORECASE), "admin"),
    (re.compile(r"^(i40e|ice|iecm|iavf)-.+-TxRx-(?P<q>\d+)$"), "queue"),
    (re.compile(r"^(i40e|ice|iecm|iavf)-.*:(misc|mbx)$"), "admin"),
    (re.compile(r"^virtio\d+-(input|output)\.(?P<q>\d+)$"), "queue"),
    (re.compile(r"^virtio\d+-config$"), "admin"),
    (re.compile(r"^ena-mgmnt"), "admin"),
]


def _name_of(tokens: list[str]) -> str | None:
    """The action names at the end of an interrupts line ("a, b" for shared IRQs)."""
    if not tokens or _TRIGGER_RE.match(tokens[-1]) or len(tokens) < 2:
        return None
    names = [tokens[-1]]
    i = len(tokens) - 2
    while i >= 1 and tokens[i].endswith(","):  # keep tokens[0]: the chip name
        names.insert(0, tokens[i])
        i -= 1
    return " ".join(names)


def parse_interrupts(text: str) -> dict[int, str | None]:
    """IRQ number → name (last column; ``None`` when the line has no action name).

    Handles any chip column ("IO-APIC 2-edge", "IR-PCI-MSIX-0000:00:03.0 2-edge",
    old "PCI-MSI-edge") and skips the per-CPU summary rows (NMI, LOC, ...).
    """
    lines = text.splitlines()
    if not lines:
        return {}
    ncpu = sum(1 for t in lines[0].split() if t.startswith("CPU"))
    out: dict[int, str | None] = {}
    for line in lines[1:]:
        head, sep, rest = line.partition(":")
        if not sep or not head.strip().isdigit():
            continue
        tokens = rest.split()
        k = 0
        while k < len(tokens) and k < ncpu and tokens[k].isdigit():
            k += 1
        out[int(head)] = _name_of(tokens[k:])
    return out


def classify_irq(name: str | None, ifname: str) -> tuple[IrqKind, int | None]:
    """(kind, queue number) for one vector name of interface ``ifname``."""
    if not name:
        return "unknown", None
    for pat, kind in _PATTERNS:
        m = pat.match(name)
        if m:
            q = m.groupdict().get("q")
            return kind, int(q) if q is not None else None
    if name == ifname:
        return "admin", None
    m = re.match(re.escape(ifname) + r"-(TxRx|rx|tx|Tx-Rx|combined)-(\d+)$", name)
    if m:
        return "queue", int(m.group(2))
    return "unknown", None


def irq_affinity(fs: Root, irq: int) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(``smp_affinity_list`` else the ``smp_affinity`` mask, ``effective_affinity_list``
    else its mask); each ``None`` when unreadable."""
    base = f"proc/irq/{irq}"
    aff = read_cpus(fs, f"{base}/smp_affinity_list", f"{base}/smp_affinity", "", None)
    eff = read_cpus(fs, f"{base}/effective_affinity_list", f"{base}/effective_affinity", "", None)
    return aff, eff


_IRQ_DIR_FILES = {
    "affinity_hint", "effective_affinity", "effective_affinity_list", "node",
    "smp_affinity", "smp_affinity_list", "spurious",
}


def irq_name_from_proc_dir(fs: Root, irq: int) -> str | None:
    """The action name from ``proc/irq/N/<name>/`` (the kernel makes one dir per action)."""
    names = [e for e in fs.listdir(f"proc/irq/{irq}") if e not in _IRQ_DIR_FILES]
    return ", ".join(names) if names else None
