"""Declared topology files: replace / correct sysfs nodes; every bad file is a UsageError."""

from __future__ import annotations

import re

import pytest

from numaserve.errors import UsageError
from numaserve.topology import discover

SPLIT_VM = """\
mode = "replace"
[[node]]
id = 0
cpus = "0"
memory_node = 0
[[node]]
id = 1
cpus = "1"
memory_node = 0
[nic.eth0]
node = 1
"""


@pytest.fixture
def one_node_vm(fake):
    """This dev VM's shape: 2 CPUs, one node, virtio eth0 with numa_node -1."""
    fake.cpus("0-1")
    fake.node_lists("0", has_memory="0")
    fake.node(0, "0-1", distance="10", mem_kb=(4024536, 3500000), hugepages={2048: (4, 4)})
    fake.nic("eth0", "0000:00:03.0", driver="virtio_net", virtio="virtio2", local_cpulist="0-1", msi=[37, 38, 39])
    return fake


def declare(tmp_path, text, name="topo.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_replace_splits_one_node_vm_into_two_pretend_nodes(one_node_vm, tmp_path):
    path = declare(tmp_path, SPLIT_VM)
    topo = discover(str(one_node_vm), declared=path)
    assert topo.declared == path
    assert topo.node_ids == (0, 1)
    n0, n1 = topo.nodes
    assert (n0.cpus, n1.cpus) == ((0,), (1,))
    assert (n0.usable_cpus, n1.usable_cpus) == ((0,), (1,))
    assert n0.bind_node == 0 and n1.bind_node == 0 and n1.memory_node == 0
    # memory comes from the memory node's sysfs entry
    assert n1.memory_total_bytes == n0.memory_total_bytes == 4024536 * 1024
    assert n1.hugepages == n0.hugepages and n1.hugepages[0].total == 4
    assert n0.memory_allowed and n1.memory_allowed
    # same memory node: distance 10 both ways
    assert n0.distances == {0: 10, 1: 10} and n1.distances == {0: 10, 1: 10}
    # real ids stay real where memory policies need them
    assert topo.possible_nodes == (0,) and topo.allowed_mems == (0,)
    assert topo.cpu_node() == {0: 0, 1: 1}
    (eth0,) = topo.nics
    assert (eth0.numa_node, eth0.numa_node_source) == (1, "declared")
    j = topo.to_json()
    assert [(n["id"], n["cpus"], n["memory_node"]) for n in j["nodes"]] == [(0, [0], 0), (1, [1], 0)]
    assert j["declared"] == path and j["nodes"][1]["nics"] == ["eth0"]


def test_nic_nodes_argument_wins_over_file(one_node_vm, tmp_path):
    topo = discover(str(one_node_vm), declared=declare(tmp_path, SPLIT_VM), nic_nodes={"eth0": 0})
    assert topo.nics[0].numa_node == 0


def test_replace_maps_sysfs_numa_node_through_memory_node(two_node, tmp_path):
    two_node.nic("eth0", "0000:81:00.0", driver="mlx5_core", numa_node=1, local_cpulist="4-7", msi=[60])
    text = """
    [[node]]
    id = 10
    cpus = "0-3"
    memory_node = 0
    [[node]]
    id = 11
    cpus = "4-7"
    memory_node = 1
    """
    topo = discover(str(two_node), declared=declare(tmp_path, text))  # mode defaults to "replace"
    assert topo.node_ids == (10, 11)
    assert (topo.nics[0].numa_node, topo.nics[0].numa_node_source) == (11, "sysfs")
    assert topo.node(10).distances == {10: 10, 11: 21}
    assert topo.node(11).memory_total_bytes == 8388608 * 1024


def test_replace_two_nodes_on_one_memory_node_falls_back_to_local_cpulist(two_node, tmp_path):
    two_node.nic("eth0", "0000:81:00.0", driver="mlx5_core", numa_node=1, local_cpulist="6-7", msi=[60])
    text = """
    [[node]]
    id = 2
    cpus = "4-5"
    memory_node = 1
    [[node]]
    id = 3
    cpus = "6-7"
    memory_node = 1
    """
    topo = discover(str(two_node), declared=declare(tmp_path, text))
    assert (topo.nics[0].numa_node, topo.nics[0].numa_node_source) == (3, "local_cpulist")


def test_correct_patches_listed_nodes_and_keeps_others(two_node, tmp_path):
    text = """
    mode = "correct"
    [[node]]
    id = 1
    cpus = "4-5"
    [[node]]
    id = 2
    cpus = "6-7"
    memory_node = 1
    """
    topo = discover(str(two_node), declared=declare(tmp_path, text))
    assert topo.node_ids == (0, 1, 2)
    assert topo.node(0).cpus == (0, 1, 2, 3) and topo.node(0).memory_total_bytes == 4194304 * 1024
    assert topo.node(1).cpus == (4, 5) and topo.node(1).bind_node == 1
    n2 = topo.node(2)
    assert n2.cpus == (6, 7) and n2.bind_node == 1 and n2.memory_total_bytes == topo.node(1).memory_total_bytes
    assert topo.node(0).distances == {0: 10, 1: 21, 2: 21}
    assert topo.node(1).distances == {0: 21, 1: 10, 2: 10}
    assert n2.distances == {0: 21, 1: 10, 2: 10}


def test_correct_moves_cpus_between_sysfs_nodes(two_node, tmp_path):
    text = 'mode = "correct"\n[[node]]\nid = 0\ncpus = [0, 1, 2, 3, 4]\n'
    topo = discover(str(two_node), declared=declare(tmp_path, text))
    assert topo.node(0).cpus == (0, 1, 2, 3, 4) and topo.node(1).cpus == (5, 6, 7)


def test_correct_memory_node_only(two_node, tmp_path):
    text = 'mode = "correct"\n[[node]]\nid = 1\nmemory_node = 0\n[nic.eth0]\nnode = 0\n'
    topo = discover(str(two_node), declared=declare(tmp_path, text))
    assert topo.node(1).cpus == (4, 5, 6, 7) and topo.node(1).bind_node == 0
    assert topo.node(1).memory_total_bytes == topo.node(0).memory_total_bytes
    assert topo.node(0).distances == {0: 10, 1: 10}
    assert any(u.what == "nic eth0" for u in topo.unknowns)  # override for a NIC not present


def test_declared_cpus_outside_cgroup_are_not_usable(one_node_vm, tmp_path):
    one_node_vm.cgroup_v2("/a", "1", "0")
    topo = discover(str(one_node_vm), declared=declare(tmp_path, SPLIT_VM))
    assert topo.node(0).usable_cpus == () and topo.node(1).usable_cpus == (1,)


@pytest.mark.parametrize(
    "text, pattern",
    [
        ("mode = \n", r"invalid TOML"),
        ("mode = 'replace'\nnodes = []\n", r"unknown key nodes: expected one of mode, nic, node"),
        ("[[node]]\nid = 0\ncpus = '0'\ncpu = '1'\n", r"unknown key node\[0\]\.cpu"),
        ("mode = 'merge'\n[[node]]\nid = 0\ncpus = '0'\n", r"mode = 'merge': expected \"replace\" or \"correct\""),
        ("[[node]]\nid = 0\ncpus = '0'\n[[node]]\nid = 0\ncpus = '1'\n", r"node\[1\]\.id = 0: duplicate node id"),
        ("[[node]]\nid = 0\ncpus = '0-1'\n[[node]]\nid = 1\ncpus = '1'\n",
         r"node\[1\]\.cpus = '1': CPU 1 is already in node 0"),
        ("[[node]]\nid = 0\ncpus = '0-2'\n", r"node\[0\]\.cpus = '0-2': CPU 2 is not online \(online: 0-1\)"),
        ("[[node]]\nid = 0\ncpus = '0'\nmemory_node = 3\n", r"node\[0\]\.memory_node = 3: not a node of this machine"),
        ("[[node]]\nid = 5\ncpus = '0'\n", r"node\[0\]\.id = 5: not a node of this machine.*set memory_node"),
        ("[[node]]\nid = 0\ncpus = '0'\n[nic.eth0]\nnode = 4\n", r"nic\.eth0\.node = 4: no such node"),
        ("[[node]]\nid = 0\ncpus = '0'\n[nic.eth0]\nnodes = 0\n", r"unknown key nic\.eth0\.nodes"),
        ("[[node]]\nid = 0\ncpus = 0\n", r"node\[0\]\.cpus = 0: expected a cpulist"),
        ("[[node]]\nid = 0\ncpus = '1-0'\n", r"node\[0\]\.cpus = '1-0': expected a cpulist"),
        ("[[node]]\nid = -1\ncpus = '0'\n", r"node\[0\]\.id = -1: expected an integer >= 0"),
        ("[[node]]\nid = true\ncpus = '0'\n", r"node\[0\]\.id = True: expected an integer"),
        ("[[node]]\ncpus = '0'\n", r"node\[0\]: missing key id"),
        ("[[node]]\nid = 0\n", r"node\[0\] \(id 0\): missing key cpus"),
        ("mode = 'replace'\n", r"needs at least one \[\[node\]\]"),
        ("node = 3\n", r"node = 3: expected \[\[node\]\] tables"),
        ("mode = 'correct'\n[[node]]\nid = 9\n", r"node\[0\]\.id = 9: not a node of this machine.*needs cpus"),
    ],
)
def test_bad_declared_file_is_usage_error_naming_file_and_key(one_node_vm, tmp_path, text, pattern):
    path = declare(tmp_path, text)
    with pytest.raises(UsageError) as e:
        discover(str(one_node_vm), declared=path)
    msg = str(e.value)
    assert msg.startswith(path + ": "), msg
    assert re.search(pattern, msg), msg
    assert e.value.exit_code == 2 and "\n" not in msg


def test_missing_and_binary_declared_file(one_node_vm, tmp_path):
    with pytest.raises(UsageError, match=r"nope\.toml: declared topology file not found"):
        discover(str(one_node_vm), declared=str(tmp_path / "nope.toml"))
    p = tmp_path / "bin.toml"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UsageError, match=r"bin\.toml: not UTF-8"):
        discover(str(one_node_vm), declared=str(p))
