"""Fixtures for discovery tests: hwloc dumps (extracted once) and a fake-tree builder.

``hwloc_root(name)`` returns the directory that holds ``sys/`` of
``../shared/fixtures/hwloc/<name>.tar.bz2``, extracted once per machine
(``tests/hwloc_dumps.py``); the test is skipped when the shared fixtures are absent.  ``fake`` is a ``FakeRoot``: small sysfs/procfs trees
written as plain files and relative symlinks, like the kernel's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

import pytest

from numaserve.cpulist import format_mask, parse_list

from tests import hwloc_dumps
from tests.hwloc_dumps import HWLOC_DIR

REPO = Path(__file__).resolve().parents[3]
STATIC_TREES = REPO / "tests" / "fixtures" / "sysfs"

# fixture name -> ground-truth file (lstopo output) beside it
HWLOC_FIXTURES: dict[str, str] = {
    "32em64t-2n8c+dax+nvme+mic+dimms": "xml",
    "40intel64-2g2n4c+pcilocality": "xml",
    "32intel64-2p8co2t+8ve": "console",
    "2pa-pcidomain32bits": "console",
    "48amd64-4pa2n6c-sparse": "console",
    "nvidiagpunumanodes": "console",
}


@pytest.fixture(scope="session")
def hwloc_root() -> Callable[[str], Path]:
    """name → extracted root of that hwloc dump (extracted once per machine: tests/hwloc_dumps.py)."""
    return hwloc_dumps.extracted


@pytest.fixture(scope="session")
def static_tree() -> Callable[[str], Path]:
    """name → path of a hand-made tree under tests/fixtures/sysfs (read-only: copy before writing)."""

    def get(name: str) -> Path:
        p = STATIC_TREES / name
        assert (p / "sys").is_dir(), f"{p}: not a fake root"
        return p

    return get


@pytest.fixture
def hwloc_truth_path() -> Callable[[str], Path]:
    def get(name: str) -> Path:
        p = HWLOC_DIR / f"{name}.{HWLOC_FIXTURES[name]}"
        if not p.is_file():
            pytest.skip(f"hwloc ground truth {p} not present")
        return p

    return get


class FakeRoot:
    """Builds a tiny sysfs/procfs tree under ``path`` (files + relative symlinks)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        (path / "sys" / "devices" / "system").mkdir(parents=True, exist_ok=True)
        self._interrupts: list[tuple[int, str, str]] = []
        self._ncpu = 0

    def __str__(self) -> str:
        return str(self.path)

    # --- primitives ----------------------------------------------------------

    def write(self, rel: str, text: str | bytes) -> Path:
        p = self.path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            p.write_bytes(text)
        else:
            p.write_text(text if text == "" or text.endswith("\n") else text + "\n")
        return p

    def remove(self, rel: str) -> None:
        (self.path / rel).unlink()

    def link(self, rel: str, target_rel: str) -> None:
        """Symlink ``rel`` → ``target_rel`` (both root-relative), written as a relative link."""
        p = self.path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.is_symlink() or p.exists():
            p.unlink()
        os.symlink(os.path.relpath(self.path / target_rel, p.parent), p)

    # --- machine -------------------------------------------------------------

    def cpus(self, online: str, siblings: Iterable[str] = ()) -> None:
        """``cpu/online``, one ``cpuN`` dir per CPU, SMT sibling lists (e.g. ["0,4", "1,5"])."""
        cpus = parse_list(online)
        self._ncpu = max(cpus) + 1 if cpus else 0
        self.write("sys/devices/system/cpu/online", online)
        sib = {c: s for s in siblings for c in parse_list(s)}
        for c in cpus:
            self.write(f"sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list", sib.get(c, str(c)))

    def node(
        self,
        nid: int,
        cpulist: str,
        *,
        distance: str,
        mem_kb: tuple[int, int] = (4194304, 2097152),
        hugepages: dict[int, tuple[int, int]] | None = None,
        cpumap: bool = True,
    ) -> None:
        base = f"sys/devices/system/node/node{nid}"
        self.write(f"{base}/cpulist", cpulist)
        if cpumap:
            self.write(f"{base}/cpumap", format_mask(parse_list(cpulist)) if cpulist.strip() else "0")
        self.write(f"{base}/distance", distance)
        self.write(
            f"{base}/meminfo",
            f"Node {nid} MemTotal:       {mem_kb[0]} kB\nNode {nid} MemFree:        {mem_kb[1]} kB\n"
            f"Node {nid} MemUsed:        {mem_kb[0] - mem_kb[1]} kB\nNode {nid} HugePages_Total:     0\n",
        )
        for size, (nr, free) in (hugepages or {2048: (0, 0)}).items():
            self.write(f"{base}/hugepages/hugepages-{size}kB/nr_hugepages", str(nr))
            self.write(f"{base}/hugepages/hugepages-{size}kB/free_hugepages", str(free))
        # memory block dirs must be ignored (a file inside, so git keeps the directory)
        self.write(f"{base}/memory7/online", "1")

    def node_lists(self, online: str, possible: str | None = None, has_memory: str | None = None) -> None:
        self.write("sys/devices/system/node/online", online)
        self.write("sys/devices/system/node/possible", possible or online)
        self.write("sys/devices/system/node/has_cpu", online)
        if has_memory is not None:
            self.write("sys/devices/system/node/has_memory", has_memory)

    def two_nodes(self) -> None:
        """The usual small machine: CPUs 0-3 on node 0, 4-7 on node 1, distance 10/21."""
        self.cpus("0-7", ["0-1", "2-3", "4-5", "6-7"])
        self.node_lists("0-1", has_memory="0-1")
        self.node(0, "0-3", distance="10 21", hugepages={2048: (16, 8), 1048576: (0, 0)})
        self.node(1, "4-7", distance="21 10", mem_kb=(8388608, 6291456))

    # --- devices -------------------------------------------------------------

    def pci(
        self,
        bdf: str,
        *,
        parent: str = "pci0000:00",
        pci_class: str = "0x020000",
        numa_node: int | None = -1,
        local_cpulist: str | None = None,
        driver: str | None = None,
        msi: Iterable[int] = (),
        irq: int | None = None,
        vendor: str = "0x8086",
        device: str = "0x1234",
    ) -> str:
        """A PCI function under ``sys/devices/<parent>/``; returns its root-relative path."""
        dev = f"sys/devices/{parent}/{bdf}"
        self.write(f"{dev}/class", pci_class)
        self.write(f"{dev}/vendor", vendor)
        self.write(f"{dev}/device", device)
        if numa_node is not None:
            self.write(f"{dev}/numa_node", str(numa_node))
        if local_cpulist is not None:
            self.write(f"{dev}/local_cpulist", local_cpulist)
            self.write(f"{dev}/local_cpus", format_mask(parse_list(local_cpulist)))
        if driver:  # link text only: the target is absent, as in the hwloc dumps
            self.link(f"{dev}/driver", f"sys/bus/pci/drivers/{driver}")
        for n in msi:
            self.write(f"{dev}/msi_irqs/{n}", "msix")
        if irq is not None:
            self.write(f"{dev}/irq", str(irq))
        self.link(f"sys/bus/pci/devices/{bdf}", dev)
        return dev

    def nic(
        self,
        name: str,
        bdf: str,
        *,
        driver: str,
        rx: int = 1,
        tx: int = 1,
        virtio: str | None = None,
        **pci_kw: object,
    ) -> str:
        """A physical NIC; ``virtio="virtio2"`` puts a virtio device between PCI and netdev."""
        pci_driver = "virtio-pci" if virtio else driver
        dev = self.pci(bdf, driver=pci_driver, **pci_kw)  # type: ignore[arg-type]
        if virtio:
            dev = f"{dev}/{virtio}"
            self.link(f"{dev}/driver", f"sys/bus/virtio/drivers/{driver}")
        netdir = f"{dev}/net/{name}"
        self.link(f"{netdir}/device", dev)
        # each queue dir holds its real attribute file, so git (which drops empty
        # directories) keeps committed trees intact
        for i in range(rx):
            self.write(f"{netdir}/queues/rx-{i}/rps_cpus", "0")
        for i in range(tx):
            self.write(f"{netdir}/queues/tx-{i}/tx_maxrate", "0")
        self.link(f"sys/class/net/{name}", netdir)
        return dev

    def virtual_nic(self, name: str, *, with_device: bool = False) -> None:
        """lo/bridge/VLAN/ifb style: under devices/virtual, normally without ``device``."""
        netdir = f"sys/devices/virtual/net/{name}"
        self.write(f"{netdir}/type", "1")
        if with_device:
            self.write(f"sys/devices/virtual/misc/{name}dev/uevent", "")
            self.link(f"{netdir}/device", f"sys/devices/virtual/misc/{name}dev")
        self.link(f"sys/class/net/{name}", netdir)

    # --- procfs ---------------------------------------------------------------

    def interrupt(self, irq: int, name: str, chip: str = "PCI-MSIX-0000:00:03.0 0-edge") -> None:
        self._interrupts.append((irq, chip, name))
        self._write_interrupts()

    def _write_interrupts(self) -> None:
        ncpu = max(self._ncpu, 1)
        lines = [" " * 4 + "".join(f"CPU{c:<8}" for c in range(ncpu))]
        for irq, chip, name in sorted(self._interrupts):
            counts = "".join(f"{(irq * 7 + c) % 1000:>10}" for c in range(ncpu))
            lines.append(f"{irq:>3}:{counts}  {chip}  {name}".rstrip())
        lines.append("NMI:" + "".join(f"{0:>10}" for _ in range(ncpu)) + "   Non-maskable interrupts")
        lines.append("ERR:          0")
        self.write("proc/interrupts", "\n".join(lines))

    def irq_affinity(self, irq: int, affinity: str | None, effective: str | None = None, *, mask: bool = False) -> None:
        """``proc/irq/N`` files; ``mask=True`` writes only ``smp_affinity`` (hex), no ``_list``."""
        base = f"proc/irq/{irq}"
        if affinity is not None:
            if mask:
                self.write(f"{base}/smp_affinity", format_mask(parse_list(affinity)))
            else:
                self.write(f"{base}/smp_affinity_list", affinity)
                self.write(f"{base}/smp_affinity", format_mask(parse_list(affinity)))
        if effective is not None:
            self.write(f"{base}/effective_affinity_list", effective)
        self.write(f"{base}/node", "0")

    def status(self, cpus: str | None = None, mems: str | None = None) -> None:
        lines = ["Name:\tpython3", "State:\tR (running)"]
        if cpus is not None:
            lines += [f"Cpus_allowed:\t{format_mask(parse_list(cpus))}", f"Cpus_allowed_list:\t{cpus}"]
        if mems is not None:
            lines += [f"Mems_allowed:\t{format_mask(parse_list(mems))}", f"Mems_allowed_list:\t{mems}"]
        self.write("proc/self/status", "\n".join(lines))

    def cgroup_v2(self, path: str, cpus: str | None, mems: str | None, *, at: str | None = None) -> None:
        """``0::<path>``; the cpuset files are written at ``at`` (default ``path``)."""
        self.write("proc/self/cgroup", f"0::{path}")
        self.write("sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids")
        d = "sys/fs/cgroup" + (at if at is not None else path).rstrip("/")
        if cpus is not None:
            self.write(f"{d}/cpuset.cpus.effective", cpus)
        if mems is not None:
            self.write(f"{d}/cpuset.mems.effective", mems)

    def cgroup_v1(self, path: str, cpus: str | None, mems: str | None, *, effective: bool = True) -> None:
        self.write(
            "proc/self/cgroup",
            f"12:memory:/user.slice\n5:cpuset:{path}\n1:name=systemd:/user.slice\n0::/user.slice",
        )
        d = "sys/fs/cgroup/cpuset" + path.rstrip("/")
        suffix = ("effective_cpus", "effective_mems") if effective else ("cpus", "mems")
        if cpus is not None:
            self.write(f"{d}/cpuset.{suffix[0]}", cpus)
        if mems is not None:
            self.write(f"{d}/cpuset.{suffix[1]}", mems)

    def sysctl(self, name: str, value: str) -> None:
        self.write("proc/sys/" + name.replace(".", "/"), value)

    def process(self, pid: int, comm: str) -> None:
        self.write(f"proc/{pid}/comm", comm)


@pytest.fixture
def fake(tmp_path: Path) -> FakeRoot:
    return FakeRoot(tmp_path / "root")


@pytest.fixture
def two_node(fake: FakeRoot) -> FakeRoot:
    fake.two_nodes()
    return fake
