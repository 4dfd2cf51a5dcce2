"""GPUs and accelerators on PCI: ``sys/bus/pci/devices/*`` by class code.

Display controllers (0x03xxxx) and processing accelerators (0x12xxxx), plus
co-processors (0x0b40xx, e.g. NEC Vector Engine).  A worker that uses a GPU
should run on the GPU's node, so the node is resolved like a NIC's: sysfs
``numa_node`` ≥ 0, else a narrow ``local_cpulist``, else unknown.

Note: BMC/VM VGA adapters (ASPEED, Matrox, Cirrus) are class 0x0300 too;
callers that want compute GPUs filter by ``vendor``/``driver``.
"""

from __future__ import annotations

from typing import Callable, Sequence

from numaserve.topology.locality import locate
from numaserve.topology.model import Gpu, Node
from numaserve.topology.sysfs import Root, Unknowns, read_cpus, read_int

__all__ = ["PCI_DIR", "GPU_CLASS_PREFIXES", "DISPLAY_ONLY_VENDORS", "discover_gpus", "is_compute_gpu"]

PCI_DIR = "sys/bus/pci/devices"
GPU_CLASS_PREFIXES = ("0x03", "0x12", "0x0b40")


# VGA adapters of BMCs and hypervisors (ASPEED, Matrox, Cirrus, Bochs/QEMU, VMware,
# Red Hat virtio-gpu/QXL, Hyper-V): class 0x0300 like a GPU, but nothing to compute on
DISPLAY_ONLY_VENDORS = frozenset({"0x1a03", "0x102b", "0x1013", "0x1234", "0x15ad", "0x1af4", "0x1b36", "0x1414"})


def is_compute_gpu(gpu: Gpu) -> bool:
    """False for a BMC's or a VM's display adapter (a VGA class device of a
    display-only vendor), True for every other GPU or accelerator."""
    vga = (gpu.pci_class or "").lower().startswith("0x0300")
    return not (vga and (gpu.vendor or "").lower() in DISPLAY_ONLY_VENDORS)


def _text(fs: Root, rel: str) -> str | None:
    t = fs.read(rel)
    if t is None:
        return None
    return t.strip() or None


def discover_gpus(
    fs: Root,
    nodes: Sequence[Node],
    online_cpus: tuple[int, ...],
    unknowns: Unknowns,
    *,
    sysfs_to_node: Callable[[int], int | None] | None = None,
) -> list[Gpu]:
    """Every PCI device whose class is a display controller or accelerator."""
    gpus: list[Gpu] = []
    for entry in fs.listdir(PCI_DIR):
        rel = f"{PCI_DIR}/{entry}"
        pci_class = _text(fs, f"{rel}/class")
        if pci_class is None or not pci_class.lower().startswith(GPU_CLASS_PREFIXES):
            continue
        local = read_cpus(fs, f"{rel}/local_cpulist", f"{rel}/local_cpus", "", None)
        loc = locate(read_int(fs, f"{rel}/numa_node"), local, online_cpus, nodes, sysfs_to_node)
        if loc.node is None:
            unknowns.add(f"gpu {entry} numa_node", f"{rel}: {loc.reason}")
        link = fs.readlink(f"{rel}/driver")
        gpus.append(
            Gpu(
                pci=entry,
                vendor=_text(fs, f"{rel}/vendor"),
                device=_text(fs, f"{rel}/device"),
                pci_class=pci_class,
                driver=link.rstrip("/").rsplit("/", 1)[-1] if link else None,
                numa_node=loc.node,
                numa_node_source=loc.source,
            )
        )
    return gpus
