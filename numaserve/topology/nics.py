"""Physical NICs from ``sys/class/net``: PCI function, driver, node, queues, IRQs.

Only interfaces with a ``device`` link that is not under ``/devices/virtual/``
are NICs (lo, bridges, VLANs, veth, tun, ifb, bonds, ``mic*`` are skipped).
Locality and ``msi_irqs`` live on the PCI function: walk up from the device
to the first ``DDDD[DDDD]:BB:DD.F`` component (virtio: ``device`` is
``virtioN``, its PCI parent has the attributes).  The IRQ set is
``msi_irqs/`` (authoritative), else the INTx ``irq`` file (0 and 255 ignored,
as irqbalance does).  Names come from ``/proc/interrupts``.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping, Sequence

from numaserve.cpulist import format_list
from numaserve.topology.interrupts import classify_irq, irq_affinity, irq_name_from_proc_dir
from numaserve.topology.locality import Location, locate
from numaserve.topology.model import Irq, Nic, Node
from numaserve.topology.sysfs import Root, Unknowns, read_cpus, read_int

__all__ = ["NET_DIR", "PCI_FUNCTION_RE", "discover_nics", "pci_function", "device_irqs"]

NET_DIR = "sys/class/net"
PCI_FUNCTION_RE = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_QUEUE_RE = re.compile(r"^(rx|tx)-(\d+)$")


def pci_function(dev_path: str) -> str | None:
    """The in-root path of the PCI function at or above ``dev_path``; ``None`` when none."""
    parts = dev_path.strip("/").split("/")
    for i in range(len(parts) - 1, -1, -1):
        if PCI_FUNCTION_RE.match(parts[i]):
            return "/" + "/".join(parts[: i + 1])
    return None


def device_irqs(fs: Root, attr_dir: str) -> list[int]:
    """IRQ numbers of a device: ``msi_irqs/`` names, else the INTx ``irq`` (not 0/255)."""
    msi = sorted(int(e) for e in fs.listdir(f"{attr_dir}/msi_irqs") if e.isdigit())
    if msi:
        return msi
    intx = read_int(fs, f"{attr_dir}/irq")
    return [intx] if intx not in (None, 0, 255) else []


def _driver(fs: Root, dev_rel: str) -> str | None:
    # the link target is often absent in dumps: read the link text, never exists()
    link = fs.readlink(f"{dev_rel}/driver")
    return link.rstrip("/").rsplit("/", 1)[-1] if link else None


def _queues(fs: Root, rel: str) -> tuple[int, int]:
    rx = tx = 0
    for e in fs.listdir(f"{rel}/queues"):
        m = _QUEUE_RE.match(e)
        if m:
            if m.group(1) == "rx":
                rx += 1
            else:
                tx += 1
    return rx, tx


def _irqs(
    fs: Root, name: str, irq_numbers: list[int], irq_names: Mapping[int, str | None] | None, unknowns: Unknowns
) -> list[Irq]:
    out: list[Irq] = []
    no_aff: list[int] = []
    for n in irq_numbers:
        label = irq_names.get(n) if irq_names is not None else None
        if label is None:
            label = irq_name_from_proc_dir(fs, n)
        kind, queue = classify_irq(label, name)
        aff, eff = irq_affinity(fs, n)
        if aff is None:
            no_aff.append(n)
        out.append(Irq(irq=n, name=label, kind=kind, queue=queue, affinity=aff, effective_affinity=eff))
    if no_aff:
        unknowns.add(
            f"nic {name} irq affinity",
            f"proc/irq/N/smp_affinity_list unreadable for IRQs {format_list(no_aff)}",
        )
    return out


def discover_nics(
    fs: Root,
    nodes: Sequence[Node],
    online_cpus: tuple[int, ...],
    irq_names: Mapping[int, str | None] | None,
    unknowns: Unknowns,
    *,
    overrides: Mapping[str, int] | None = None,
    sysfs_to_node: Callable[[int], int | None] | None = None,
) -> list[Nic]:
    """Every physical NIC, by name.  ``overrides`` (interface → node) win over sysfs."""
    overrides = overrides or {}
    nics: list[Nic] = []
    for name in fs.listdir(NET_DIR):
        rel = f"{NET_DIR}/{name}"
        dev_rel = f"{rel}/device"
        if fs.readlink(dev_rel) is None and not fs.is_dir(dev_rel):
            continue  # lo, bridges, VLANs, veth, tun, ifb, bonds
        dev_path = fs.resolve(dev_rel)
        if "/devices/virtual/" in dev_path + "/" or "/devices/virtual/" in fs.resolve(rel):
            continue
        pci_path = pci_function(dev_path)
        attr = (pci_path or dev_path).lstrip("/")
        local = read_cpus(fs, f"{attr}/local_cpulist", f"{attr}/local_cpus", "", None)
        if local is not None and online_cpus:
            online = set(online_cpus)
            local = tuple(c for c in local if c in online)
        if name in overrides:
            loc = Location(overrides[name], "declared")
        else:
            loc = locate(read_int(fs, f"{attr}/numa_node"), local, online_cpus, nodes, sysfs_to_node)
            if loc.node is None:
                unknowns.add(f"nic {name} numa_node", f"{attr}: {loc.reason}")
        driver = _driver(fs, dev_rel)
        if driver is None:
            unknowns.add(f"nic {name} driver", f"{dev_rel}/driver: no link")
        irq_numbers = device_irqs(fs, attr)
        if not irq_numbers:
            unknowns.add(f"nic {name} irqs", f"{attr}: no msi_irqs/ and no usable irq file")
        rx, tx = _queues(fs, rel)
        nics.append(
            Nic(
                name=name,
                driver=driver,
                pci=pci_path.rsplit("/", 1)[-1] if pci_path else None,
                numa_node=loc.node,
                numa_node_source=loc.source,
                local_cpus=tuple(local or ()),
                rx_queues=rx,
                tx_queues=tx,
                irqs=_irqs(fs, name, irq_numbers, irq_names, unknowns),
                device_path=dev_path,
            )
        )
    return nics
