"""Allowed CPUs and memory nodes: online ∩ affinity ∩ cgroup cpuset (v1 and v2)."""

from __future__ import annotations

from numaserve.cpulist import parse_list
from numaserve.topology import discover
from numaserve.topology.allowed import parse_proc_cgroup


def usable(topo):
    return {n.id: n.usable_cpus for n in topo.nodes}


def test_no_cgroup_no_status_allows_everything(two_node):
    topo = discover(str(two_node))
    assert topo.allowed_cpus == tuple(range(8)) and topo.allowed_mems == (0, 1)
    assert usable(topo) == {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}
    assert any(u.what == "cgroup cpuset" for u in topo.unknowns)


def test_cgroup_v2_cpuset_narrower_than_machine(two_node):
    two_node.cgroup_v2("/system.slice/app.service", "2-5", "1")
    topo = discover(str(two_node))
    assert topo.system.cgroup_version == 2
    assert topo.allowed_cpus == (2, 3, 4, 5)
    assert usable(topo) == {0: (2, 3), 1: (4, 5)}
    assert topo.node(0).cpus == (0, 1, 2, 3)  # the node itself is unchanged
    assert topo.allowed_mems == (1,)
    assert [n.memory_allowed for n in topo.nodes] == [False, True]


def test_cgroup_v2_walks_up_to_nearest_ancestor_with_the_file(two_node):
    # leaf cgroup has no cpuset files (controller not enabled there); the parent has them
    two_node.cgroup_v2("/kubepods.slice/pod1/ctr", "4-7", "1", at="/kubepods.slice")
    (two_node.path / "sys/fs/cgroup/kubepods.slice/pod1/ctr").mkdir(parents=True)
    topo = discover(str(two_node))
    assert topo.allowed_cpus == (4, 5, 6, 7) and topo.allowed_mems == (1,)


def test_cgroup_v2_root_without_cpuset_files_does_not_narrow(two_node):
    two_node.cgroup_v2("/", None, None)
    topo = discover(str(two_node))
    assert topo.allowed_cpus == tuple(range(8))
    assert not any(u.what.startswith("cgroup cpuset") for u in topo.unknowns)


def test_cgroup_v1_effective_cpus(two_node):
    two_node.cgroup_v1("/jobs/42", "0-1,6", "0")
    topo = discover(str(two_node))
    assert topo.system.cgroup_version == 1
    assert topo.allowed_cpus == (0, 1, 6) and topo.allowed_mems == (0,)
    assert usable(topo) == {0: (0, 1), 1: (6,)}


def test_cgroup_v1_plain_cpuset_files(two_node):
    two_node.cgroup_v1("/jobs/42", "4-5", "1", effective=False)
    topo = discover(str(two_node))
    assert topo.allowed_cpus == (4, 5) and topo.allowed_mems == (1,)


def test_cgroup_v1_path_missing_records_unknown(two_node):
    two_node.cgroup_v1("/jobs/42", None, None)
    topo = discover(str(two_node))
    assert topo.allowed_cpus == tuple(range(8))
    assert any(u.what == "cgroup cpuset cpus" for u in topo.unknowns)


def test_affinity_from_dump_status_and_mems_allowed(two_node):
    two_node.status(cpus="1-6", mems="0")
    two_node.cgroup_v2("/a", "0-5", None)
    topo = discover(str(two_node))
    assert topo.allowed_cpus == (1, 2, 3, 4, 5)  # online ∩ affinity ∩ cgroup
    assert topo.allowed_mems == (0,)


def test_garbage_cgroup_and_status_do_not_narrow(two_node):
    two_node.write("proc/self/status", "Cpus_allowed_list:\tzz-top\nMems_allowed_list:\t\n")
    two_node.cgroup_v2("/a", "not,a,list", "0-1")
    topo = discover(str(two_node))
    assert topo.allowed_cpus == tuple(range(8))
    whats = {u.what for u in topo.unknowns}
    assert {"cpu affinity", "mems allowed", "cgroup cpuset cpus"} <= whats


def test_offline_cpus_never_allowed(two_node):
    two_node.write("sys/devices/system/cpu/online", "0-5")
    two_node.cgroup_v2("/a", "0-7", None)
    topo = discover(str(two_node))
    assert topo.online_cpus == tuple(range(6)) and topo.allowed_cpus == tuple(range(6))
    assert topo.node(1).cpus == (4, 5)


def test_static_tree_cgroup_v2_and_status(static_tree):
    topo = discover(str(static_tree("2node-nics")))
    # Cpus_allowed_list 0-6 ∩ cpuset.cpus.effective 1-7; mems only on the parent cgroup
    assert topo.allowed_cpus == parse_list("1-6")
    assert topo.allowed_mems == (0, 1)
    assert usable(topo) == {0: (1, 2, 3), 1: (4, 5, 6)}


def test_parse_proc_cgroup():
    hybrid = "9:name=systemd:/\n4:memory:/x\n3:cpuset:/\n2:cpu,cpuacct:/\n0::/\n"
    assert parse_proc_cgroup(hybrid) == ("/", "/")
    assert parse_proc_cgroup("0::/user.slice/a.scope\n") == (None, "/user.slice/a.scope")
    assert parse_proc_cgroup("7:cpuset,cpu:/jjh\n") == ("/jjh", None)
    assert parse_proc_cgroup("garbage\n::\n") == (None, None)
