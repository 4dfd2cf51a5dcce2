"""Discovery on real machines' sysfs dumps (hwloc fixtures) against lstopo's ground truth.

The ``.console``/``.xml`` beside each tarball is what hwloc's own test expects
lstopo to print for that dump; NUMA node ids, their CPU sets, SMT cores and
distances are parsed from it here, never hard-coded.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from numaserve.cpulist import parse_list, parse_mask
from numaserve.topology import discover

pytestmark = pytest.mark.fixtures

ALL = [
    "32em64t-2n8c+dax+nvme+mic+dimms",
    "40intel64-2g2n4c+pcilocality",
    "32intel64-2p8co2t+8ve",
    "2pa-pcidomain32bits",
    "48amd64-4pa2n6c-sparse",
    "nvidiagpunumanodes",
]


@dataclass
class Truth:
    nodes: dict[int, set[int]]  # node os index -> PU os indexes
    cores: list[set[int]]  # PU sets of each core
    distances: dict[int, dict[int, int]] = field(default_factory=dict)
    pci_node: dict[str, int] = field(default_factory=dict)  # busid -> node (console only)


# --- lstopo console -------------------------------------------------------------

_NODE_RE = re.compile(r"^NUMANode L#(\d+) \(P#(\d+)")
_PU_RE = re.compile(r"^PU L#\d+ \(P#(\d+)\)")
_CORE_RE = re.compile(r"^Core L#\d+")
_PCI_RE = re.compile(r"^PCI L#\d+ \(busid=([0-9a-f:.]+)")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _subtree(lines: list[str], i: int) -> list[str]:
    """The lines below lines[i] in the tree (deeper indentation, up to the next sibling)."""
    out = []
    for line in lines[i + 1:]:
        if not line.strip() or _indent(line) <= _indent(lines[i]):
            break
        out.append(line.strip())
    return out


def parse_console(path: Path) -> Truth:
    lines = path.read_text().splitlines()
    tree_end = next(i for i, ln in enumerate(lines) if ln.startswith("depth 0:"))
    tree = lines[:tree_end]
    nodes: dict[int, set[int]] = {}
    logical: dict[int, int] = {}
    cores: list[set[int]] = []
    pci_node: dict[str, int] = {}
    current_node: int | None = None
    for i, line in enumerate(tree):
        s = line.strip()
        if m := _NODE_RE.match(s):
            logical[int(m.group(1))] = current_node = int(m.group(2))
            # a NUMANode is a memory child of its parent: its CPUs are the parent's PUs
            parent = next(j for j in range(i - 1, -1, -1) if _indent(tree[j]) < _indent(line))
            nodes[current_node] = {int(p.group(1)) for x in _subtree(tree, parent) if (p := _PU_RE.match(x))}
        elif _CORE_RE.match(s):
            cores.append({int(p.group(1)) for x in _subtree(tree, i) if (p := _PU_RE.match(x))})
        elif (m := _PCI_RE.match(s)) and current_node is not None:
            pci_node[m.group(1)] = current_node
    distances: dict[int, dict[int, int]] = {}
    for i, line in enumerate(lines):
        if line.startswith("Relative latency matrix"):
            for row in lines[i + 2: i + 2 + len(logical)]:
                vals = [int(v) for v in row.split()]
                distances[logical[vals[0]]] = {logical[j]: d for j, d in enumerate(vals[1:])}
            break
    return Truth(nodes=nodes, cores=cores, distances=distances, pci_node=pci_node)


# --- lstopo XML -------------------------------------------------------------------


def _hwloc_set(text: str) -> set[int]:
    """hwloc bitmap "0x000000ff,0xffffffff" (32-bit groups, most significant first)."""
    return set(parse_mask(",".join(g.strip()[2:] if g.strip().startswith("0x") else g for g in text.split(","))))


def parse_xml(path: Path) -> Truth:
    root = ET.parse(path).getroot()
    parent_of = {child: parent for parent in root.iter() for child in parent}
    nodes: dict[int, set[int]] = {}
    cores: list[set[int]] = []
    for obj in root.iter("object"):
        if obj.get("type") == "NUMANode":
            nodes[int(obj.get("os_index", "-1"))] = _hwloc_set(parent_of[obj].get("cpuset", "0x0"))
        elif obj.get("type") == "Core":
            cores.append({int(pu.get("os_index", "-1")) for pu in obj.iter("object") if pu.get("type") == "PU"})
    distances: dict[int, dict[int, int]] = {}
    for d in root.iter("distances2"):
        if d.get("type") != "NUMANode" or d.get("name") != "NUMALatency":
            continue
        idx = [int(x) for x in d.find("indexes").text.split()]  # type: ignore[union-attr]
        vals = [int(x) for v in d.findall("u64values") for x in (v.text or "").split()]
        n = len(idx)
        distances = {idx[i]: {idx[j]: vals[i * n + j] for j in range(n)} for i in range(n)}
    return Truth(nodes=nodes, cores=cores, distances=distances)


@pytest.fixture
def truth(hwloc_truth_path):
    def get(name: str) -> Truth:
        p = hwloc_truth_path(name)
        return parse_xml(p) if p.suffix == ".xml" else parse_console(p)

    return get


# --- every fixture ----------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_nodes_and_cpus_match_lstopo(name, hwloc_root, truth):
    t = truth(name)
    assert t.nodes, f"ground truth parser found no NUMA node in {name}"
    topo = discover(str(hwloc_root(name)))
    found = {n.id: set(n.cpus) for n in topo.nodes}
    # every node lstopo shows exists with exactly its CPUs
    assert {k: found.get(k) for k in t.nodes} == t.nodes
    # nodes lstopo hides (NVIDIA GPU memory nodes) can only be CPU-less ones
    assert all(not found[k] for k in set(found) - set(t.nodes))
    assert topo.node_ids == tuple(sorted(found))
    assert set(topo.online_cpus) == set().union(*t.nodes.values())


@pytest.mark.parametrize("name", ALL)
def test_distances_match_lstopo_and_diagonal_is_10(name, hwloc_root, truth):
    t = truth(name)
    topo = discover(str(hwloc_root(name)))
    for n in topo.nodes:
        assert set(n.distances) == set(topo.node_ids), f"node {n.id} distances not keyed by node id"
        assert n.distances[n.id] == 10
    for a, row in t.distances.items():
        assert {b: topo.node(a).distances[b] for b in row} == row


@pytest.mark.parametrize("name", ALL)
def test_smt_siblings_match_lstopo_cores(name, hwloc_root, truth):
    t = truth(name)
    topo = discover(str(hwloc_root(name)))
    for core in t.cores:
        for cpu in core:
            assert set(topo.smt_siblings[cpu]) == core, f"cpu {cpu}"


# --- specific facts (fixtures README table) ---------------------------------------


def test_48amd64_sparse_node_ids(hwloc_root):
    topo = discover(str(hwloc_root("48amd64-4pa2n6c-sparse")))
    assert topo.node_ids == (0, 1, 2, 33, 34, 45, 72, 73)
    assert topo.possible_nodes == topo.node_ids
    assert all(n.distances[n.id] == 10 for n in topo.nodes)
    # column j of nodeK/distance is the j-th *online* node: 33 is the 4th column
    assert topo.node(0).distances[33] == 22 and topo.node(0).distances[34] == 16
    assert topo.nics == []


def test_nvidia_cpu_less_gpu_memory_nodes(hwloc_root, truth):
    topo = discover(str(hwloc_root("nvidiagpunumanodes")))
    assert topo.node_ids == (0, 8, 250, 251, 252, 253, 254, 255)
    for nid in range(250, 256):
        n = topo.node(nid)
        assert n.cpu_less and n.cpus == () and n.has_memory
        assert n.memory_total_bytes and n.memory_total_bytes > 0
    assert not topo.node(0).cpu_less and not topo.node(8).cpu_less
    # the dump was taken in cgroup v1 cpuset /jjh: effective_cpus 0-87, effective_mems 0
    assert topo.system.cgroup_version == 1
    assert topo.allowed_cpus == parse_list("0-15")
    assert topo.allowed_mems == (0,)
    assert topo.node(8).usable_cpus == () and not topo.node(8).memory_allowed
    # GPUs have no numa_node file: located by local_cpus, as lstopo places them
    t = truth("nvidiagpunumanodes")
    assert t.pci_node
    assert {g.pci: g.numa_node for g in topo.gpus} == t.pci_node
    assert {g.numa_node_source for g in topo.gpus} == {"local_cpulist"}


def test_32em64t_nics_per_node(hwloc_root):
    topo = discover(str(hwloc_root("32em64t-2n8c+dax+nvme+mic+dimms")))
    nics = {x.name: x for x in topo.nics}
    assert set(nics) == {"eth0", "eth1", "ib0"}  # lo, br0, eth0.1015 (VLAN), mic0 skipped
    for name in ("eth0", "eth1"):
        x = nics[name]
        assert (x.driver, x.numa_node, x.numa_node_source) == ("igb", 0, "sysfs")
        assert x.local_cpus == parse_list("0-7")
        assert len(x.irqs) == 9 and x.rx_queues == 8
        assert x.pci is not None and x.device_path and x.device_path.endswith(x.pci)
    assert [i.irq for i in nics["eth0"].irqs] == list(range(101, 110))
    ib0 = nics["ib0"]
    assert (ib0.driver, ib0.numa_node, ib0.pci) == ("mlx4_core", 1, "0000:82:00.0")
    assert ib0.local_cpus == parse_list("8-15") and len(ib0.irqs) == 128
    # no /proc/interrupts nor /proc/irq in the dump: names and affinities unknown, not a crash
    assert all(i.name is None and i.kind == "unknown" and i.affinity is None for i in nics["eth0"].irqs)
    assert any(u.what == "irq names" for u in topo.unknowns)
    assert topo.to_json()["nodes"][0]["nics"] == ["eth0", "eth1"]


def test_40intel64_numa_node_minus_one_is_unknown(hwloc_root):
    topo = discover(str(hwloc_root("40intel64-2g2n4c+pcilocality")))
    # interleaved numbering: node 0 = 0,4,8,...
    assert topo.node(0).cpus == tuple(range(0, 40, 4))
    nics = {x.name: x for x in topo.nics}
    for name in ("eth0", "eth1", "eth2", "eth3"):
        x = nics[name]
        assert x.driver == "bnx2"
        assert x.numa_node is None and x.numa_node_source == "unknown"
        assert x.local_cpus == tuple(range(40))  # every CPU: says nothing
        assert any(u.what == f"nic {name} numa_node" and "-1" in u.reason for u in topo.unknowns)
        assert len(x.irqs) == 1  # no msi_irqs: the INTx irq file
    assert nics["eth0"].irqs[0].irq == 34
    # ib0: sysfs says node 2 (local_cpulist is all CPUs): sysfs wins
    assert (nics["ib0"].numa_node, nics["ib0"].numa_node_source) == (2, "sysfs")
    j = topo.to_json()
    assert [x["numa_node"] for x in j["nics"] if x["name"] == "eth0"] == [None]


def test_2pa_virtio_attributes_on_pci_parent(hwloc_root):
    topo = discover(str(hwloc_root("2pa-pcidomain32bits")))
    (ens3,) = topo.nics
    assert ens3.name == "ens3" and ens3.driver == "virtio_net"
    assert ens3.pci == "0000:00:03.0"
    assert ens3.device_path is not None and ens3.device_path.endswith("/0000:00:03.0/virtio0")
    assert [i.irq for i in ens3.irqs] == [24, 25, 26]
    assert ens3.numa_node is None  # -1, and local_cpulist 0-1 is every CPU
    assert (ens3.rx_queues, ens3.tx_queues) == (1, 1)


def test_32intel64_i40e_and_smt_cpulists(hwloc_root):
    topo = discover(str(hwloc_root("32intel64-2p8co2t+8ve")))
    assert topo.node(0).cpus == parse_list("0-7,16-23")
    assert topo.node(1).cpus == parse_list("8-15,24-31")
    nics = {x.name: x for x in topo.nics}
    assert set(nics) == {"enp96s0f0", "enp96s0f1"}
    for x in nics.values():
        assert (x.driver, x.numa_node, x.numa_node_source) == ("i40e", 0, "sysfs")
        assert x.local_cpus == parse_list("0-7,16-23")
        assert len(x.irqs) == 99
    assert topo.smt_siblings[0] == (0, 16)
    assert topo.system.kernel == "3.10.0-1160.15.2.el7.x86_64"  # from proc/version
    # the NEC Vector Engines (class 0x0b40) are listed as accelerators on node 0
    ve = [g for g in topo.gpus if g.vendor == "0x1bcf"]
    assert len(ve) == 8 and {g.numa_node for g in ve} == {0} and {g.driver for g in ve} == {"ve_drv"}
