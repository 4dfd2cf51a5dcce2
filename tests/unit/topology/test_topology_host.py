"""Discovery on this machine (root "/"), checked against the kernel's own files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from numaserve.cpulist import parse_list
from numaserve.topology import discover

SYS_NODE = Path("/sys/devices/system/node")
SYS_NET = Path("/sys/class/net")


@pytest.fixture(scope="module")
def topo():
    return discover()


def test_host_nodes_match_sysfs(topo):
    online = set(parse_list(Path("/sys/devices/system/cpu/online").read_text()))
    assert set(topo.online_cpus) == online
    if not SYS_NODE.is_dir() or not list(SYS_NODE.glob("node[0-9]*")):
        pytest.skip("kernel without NUMA nodes")
    for n in topo.nodes:
        assert set(n.cpus) == set(parse_list((SYS_NODE / f"node{n.id}" / "cpulist").read_text())) & online
        assert n.distances[n.id] == 10
    assert sorted(c for n in topo.nodes for c in n.cpus) == sorted(online)


def test_host_node0_cpus_and_allowed(topo):
    affinity = set(os.sched_getaffinity(0))
    assert set(topo.allowed_cpus) == affinity & set(topo.online_cpus)
    node0 = topo.node(0)
    expected = parse_list((SYS_NODE / "node0" / "cpulist").read_text()) if SYS_NODE.is_dir() else topo.online_cpus
    assert node0.cpus == tuple(c for c in expected if c in topo.online_cpus)
    assert set(node0.usable_cpus) == set(node0.cpus) & affinity
    assert node0.memory_total_bytes and node0.memory_total_bytes > 0
    assert 0 in topo.allowed_mems


def test_host_physical_nics_only(topo):
    names = {x.name for x in topo.nics}
    for virtual in ("lo", "ifb0", "ifb1"):
        assert virtual not in names
    expected = {
        p.name for p in SYS_NET.iterdir()
        if (p / "device").exists() and "/devices/virtual/" not in os.path.realpath(p)
    }
    assert names == expected


@pytest.mark.skipif(not (SYS_NET / "eth0" / "device").exists(), reason="no eth0 on this machine")
def test_host_eth0(topo):
    eth0 = next(x for x in topo.nics if x.name == "eth0")
    dev = os.path.realpath(SYS_NET / "eth0" / "device")
    assert eth0.device_path == dev
    if os.path.basename(dev).startswith("virtio"):
        assert eth0.driver == "virtio_net"
        assert eth0.pci == os.path.basename(os.path.dirname(dev))
        msi = sorted(int(e) for e in os.listdir(os.path.join(os.path.dirname(dev), "msi_irqs")))
        assert [i.irq for i in eth0.irqs] == msi
        kinds = {i.name: i.kind for i in eth0.irqs}
        assert any(k.endswith("-config") and v == "admin" for k, v in kinds.items())
        assert any("-input." in k and v == "queue" for k, v in kinds.items())
        for i in eth0.irqs:
            assert i.affinity == parse_list(Path(f"/proc/irq/{i.irq}/smp_affinity_list").read_text())


def test_host_system_facts(topo):
    s = topo.system
    assert s.kernel == os.uname().release
    assert s.irqbalance_running is not None
    assert s.cgroup_version in (1, 2)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists():
        assert f"[{s.thp}]" in thp.read_text()
    if Path("/proc/sys/net/core/somaxconn").exists():
        assert s.sysctls["net.core.somaxconn"] == int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert topo.root == "/"


def test_host_json_roundtrip(topo):
    import json

    j = json.loads(json.dumps(topo.to_json()))
    assert j["nodes"][0]["id"] == topo.nodes[0].id
