"""NIC discovery on hand-made trees: PCI walk, driver, locality, queues, IRQ names/kinds/affinity.

``tests/fixtures/sysfs/2node-nics`` is a static 2-node machine (see its README);
smaller variants are built per test with the ``fake`` builder (conftest).
"""

from __future__ import annotations

import pytest

from numaserve.cpulist import parse_list
from numaserve.topology import discover

STATIC = "2node-nics"


@pytest.fixture(scope="module")
def topo(static_tree):
    return discover(str(static_tree(STATIC)))


def nic(topo, name):
    return next(x for x in topo.nics if x.name == name)


def irqs(x):
    return [(i.irq, i.name, i.kind, i.queue) for i in x.irqs]


def test_only_physical_nics(topo):
    # lo, br0, eth1.100, veth1a2b, ifb0 are under devices/virtual without a device link
    assert [x.name for x in topo.nics] == ["ens1f0", "ens2", "ens3", "eth0", "eth1"]


def test_mlx5_completion_and_async_vectors(topo):
    x = nic(topo, "eth0")
    assert (x.driver, x.pci, x.numa_node, x.numa_node_source) == ("mlx5_core", "0000:81:00.0", 1, "sysfs")
    assert (x.rx_queues, x.tx_queues) == (4, 4)
    assert irqs(x) == [(60, "mlx5_async0@pci:0000:81:00.0", "admin", None)] + [
        (61 + q, f"mlx5_comp{q}@pci:0000:81:00.0", "queue", q) for q in range(4)
    ]
    by = {i.irq: i for i in x.irqs}
    assert by[60].affinity == tuple(range(8)) and by[60].effective_affinity == (4,)
    assert [by[61 + q].affinity for q in range(4)] == [(4,), (5,), (6,), (7,)]


def test_i40e_txrx_and_misc(topo):
    x = nic(topo, "ens1f0")
    assert (x.driver, x.numa_node, x.local_cpus) == ("i40e", 0, parse_list("0-3"))
    assert irqs(x) == [(40, "i40e-0000:3b:00.0:misc", "admin", None)] + [
        (41 + q, f"i40e-ens1f0-TxRx-{q}", "queue", q) for q in range(4)
    ]
    by = {i.irq: i for i in x.irqs}
    # IRQ 41 has only the hex smp_affinity and no effective_affinity file
    assert by[41].affinity == (1,) and by[41].effective_affinity is None
    assert by[42].affinity == (0, 1, 2, 3) and by[42].effective_affinity == (0,)


def test_ice_located_by_local_cpulist(topo):
    x = nic(topo, "ens2")
    assert (x.driver, x.numa_node, x.numa_node_source) == ("ice", 0, "local_cpulist")
    assert irqs(x) == [
        (50, "ice-0000:5e:00.0:misc", "admin", None),
        (51, "ice-ens2-TxRx-0", "queue", 0),
        (52, "ice-ens2-TxRx-1", "queue", 1),
    ]


def test_igb_unknown_node_recorded(topo):
    x = nic(topo, "eth1")
    assert (x.driver, x.numa_node, x.numa_node_source) == ("igb", None, "unknown")
    assert irqs(x) == [(30, "eth1", "admin", None), (31, "eth1-TxRx-0", "queue", 0), (32, "eth1-TxRx-1", "queue", 1)]
    (u,) = [u for u in topo.unknowns if u.what == "nic eth1 numa_node"]
    assert "numa_node = -1" in u.reason and "every online CPU" in u.reason


def test_virtio_net_uses_pci_parent(topo):
    x = nic(topo, "ens3")
    assert (x.driver, x.pci) == ("virtio_net", "0000:00:03.0")
    assert x.device_path == "/sys/devices/pci0000:00/0000:00:03.0/virtio2"
    assert irqs(x) == [
        (37, "virtio2-config", "admin", None),
        (38, "virtio2-input.0", "queue", 0),
        (39, "virtio2-output.0", "queue", 0),
    ]
    assert {i.irq: i.effective_affinity for i in x.irqs} == {37: (0,), 38: (1,), 39: (2,)}


def test_gpus_and_accelerators(topo):
    gpus = {g.pci: g for g in topo.gpus}
    assert set(gpus) == {"0000:af:00.0", "0000:5f:00.0"}  # host bridge and NICs are not GPUs
    g = gpus["0000:af:00.0"]
    assert (g.vendor, g.device, g.pci_class, g.driver, g.numa_node) == ("0x10de", "0x20b0", "0x030200", "nvidia", 1)
    a = gpus["0000:5f:00.0"]
    assert (a.pci_class, a.driver, a.numa_node, a.numa_node_source) == ("0x120000", None, 0, "local_cpulist")


def test_json_contract(topo):
    j = topo.to_json()
    eth0 = next(x for x in j["nics"] if x["name"] == "eth0")
    assert eth0["numa_node"] == 1
    assert eth0["irqs"][1] == {
        "irq": 61, "name": "mlx5_comp0@pci:0000:81:00.0", "kind": "queue", "queue": 0,
        "affinity": [4], "effective_affinity": [4],
    }
    assert next(x for x in j["nics"] if x["name"] == "eth1")["numa_node"] is None
    assert {n["id"]: n["nics"] for n in j["nodes"]} == {0: ["ens1f0", "ens2"], 1: ["eth0"]}
    assert {g["pci"]: g["numa_node"] for g in j["gpus"]} == {"0000:af:00.0": 1, "0000:5f:00.0": 0}


# --- builder variants ----------------------------------------------------------------


def test_nic_node_override_wins(two_node):
    two_node.nic("eth1", "0000:02:00.0", driver="igb", numa_node=-1, local_cpulist="0-7", msi=[30])
    two_node.nic("eth0", "0000:81:00.0", driver="mlx5_core", numa_node=1, local_cpulist="4-7", msi=[60])
    topo = discover(str(two_node), nic_nodes={"eth1": 1, "eth0": 0, "eth9": 0})
    assert {x.name: (x.numa_node, x.numa_node_source) for x in topo.nics} == {
        "eth0": (0, "declared"), "eth1": (1, "declared"),
    }
    assert not any(u.what == "nic eth1 numa_node" for u in topo.unknowns)
    assert any(u.what == "nic eth9" for u in topo.unknowns)


def test_nic_override_to_missing_node_is_usage_error(two_node):
    from numaserve.errors import UsageError

    two_node.nic("eth1", "0000:02:00.0", driver="igb", msi=[30])
    with pytest.raises(UsageError, match="eth1.*5.*no such node"):
        discover(str(two_node), nic_nodes={"eth1": 5})


def test_local_cpus_mask_when_no_cpulist(two_node):
    dev = two_node.nic("eth1", "0000:02:00.0", driver="igb", numa_node=None, local_cpulist="4-7", msi=[30])
    two_node.remove(f"{dev}/local_cpulist")  # only the hex mask local_cpus "f0" is left
    x = discover(str(two_node)).nics[0]
    assert (x.numa_node, x.numa_node_source, x.local_cpus) == (1, "local_cpulist", (4, 5, 6, 7))


def test_local_cpulist_across_nodes_is_unknown(two_node):
    two_node.nic("eth1", "0000:02:00.0", driver="igb", numa_node=-1, local_cpulist="2-5", msi=[30])
    topo = discover(str(two_node))
    assert topo.nics[0].numa_node is None
    assert any("not inside exactly one node" in u.reason for u in topo.unknowns)


def test_sysfs_numa_node_not_a_node_falls_back(two_node):
    two_node.nic("eth1", "0000:02:00.0", driver="igb", numa_node=7, local_cpulist="0-3", msi=[30])
    topo = discover(str(two_node))
    assert (topo.nics[0].numa_node, topo.nics[0].numa_node_source) == (0, "local_cpulist")


def test_intx_irq_and_ignored_values(two_node):
    two_node.nic("eth0", "0000:02:00.0", driver="e1000", irq=19)
    two_node.nic("eth1", "0000:02:00.1", driver="e1000", irq=0)
    two_node.nic("eth2", "0000:02:00.2", driver="e1000", irq=255)
    topo = discover(str(two_node))
    assert {x.name: [i.irq for i in x.irqs] for x in topo.nics} == {"eth0": [19], "eth1": [], "eth2": []}
    assert any(u.what == "nic eth1 irqs" for u in topo.unknowns)


def test_msi_irqs_win_over_intx_and_sort_numerically(two_node):
    two_node.nic("eth0", "0000:02:00.0", driver="igb", irq=19, msi=[100, 9, 10])
    assert [i.irq for i in discover(str(two_node)).nics[0].irqs] == [9, 10, 100]


def test_name_from_proc_irq_dir_when_no_proc_interrupts(two_node):
    two_node.nic("eth0", "0000:00:03.0", driver="virtio_net", virtio="virtio1", msi=[24, 25])
    (two_node.path / "proc/irq/24/virtio1-config").mkdir(parents=True)
    (two_node.path / "proc/irq/25/virtio1-input.0").mkdir(parents=True)
    topo = discover(str(two_node))
    assert irqs(topo.nics[0]) == [(24, "virtio1-config", "admin", None), (25, "virtio1-input.0", "queue", 0)]
    assert any(u.what == "irq names" for u in topo.unknowns)


def test_device_link_under_devices_virtual_is_skipped(two_node):
    two_node.virtual_nic("tun0", with_device=True)
    two_node.nic("eth0", "0000:02:00.0", driver="igb", msi=[30])
    assert [x.name for x in discover(str(two_node)).nics] == ["eth0"]


def test_driver_link_missing_is_unknown(two_node):
    dev = two_node.nic("eth0", "0000:02:00.0", driver="igb", msi=[30])
    two_node.remove(f"{dev}/driver")
    topo = discover(str(two_node))
    assert topo.nics[0].driver is None
    assert any(u.what == "nic eth0 driver" for u in topo.unknowns)


def test_eight_digit_pci_domain(two_node):
    two_node.nic("eth0", "10000:00:02.0", parent="pci10000:00", driver="igb", numa_node=0, msi=[30])
    x = discover(str(two_node)).nics[0]
    assert (x.pci, x.numa_node) == ("10000:00:02.0", 0)
