"""Missing, empty and garbage files never crash discovery: value None/empty + an Unknown."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numaserve.errors import UsageError
from numaserve.topology import discover
from numaserve.topology.interrupts import classify_irq, parse_interrupts
from numaserve.topology.sysfs import Root

NODE = "sys/devices/system/node"


def whats(topo):
    return {u.what for u in topo.unknowns}


# --- roots ------------------------------------------------------------------------------


def test_missing_root_is_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no such directory"):
        discover(str(tmp_path / "absent"))


def test_root_without_sysfs_is_usage_error(tmp_path):
    (tmp_path / "proc").mkdir()
    with pytest.raises(UsageError, match="no sys/devices/system"):
        discover(str(tmp_path))
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UsageError):
        discover(str(f))


# --- non-NUMA kernel and the bare minimum -----------------------------------------------


def test_non_numa_kernel_synthesizes_node_0(fake):
    fake.cpus("0-3")
    fake.write("proc/meminfo", "MemTotal:        8000000 kB\nMemFree:         6000000 kB\nBuffers: 1 kB\n")
    fake.write("sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages", "8")
    fake.write("sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages", "2")
    topo = discover(str(fake))
    (n,) = topo.nodes
    assert (n.id, n.cpus, n.usable_cpus, n.distances) == (0, (0, 1, 2, 3), (0, 1, 2, 3), {0: 10})
    assert (n.memory_total_bytes, n.memory_free_bytes) == (8000000 * 1024, 6000000 * 1024)
    assert n.hugepages[0].size_kb == 2048 and n.hugepages[0].total == 8
    assert topo.possible_nodes == (0,) and topo.allowed_mems == (0,)
    (u,) = [u for u in topo.unknowns if u.what == "numa nodes"]
    assert "without NUMA" in u.reason


def test_node_dir_without_node_entries_is_non_numa(fake):
    fake.cpus("0-1")
    fake.write(f"{NODE}/online", "0")
    topo = discover(str(fake))
    assert topo.node_ids == (0,) and topo.node(0).cpus == (0, 1)
    assert {"numa nodes", "node 0 memory"} <= whats(topo)  # no proc/meminfo either


def test_empty_sys_tree_does_not_crash(fake):
    topo = discover(str(fake))
    assert topo.node_ids == (0,) and topo.online_cpus == ()
    assert {"online cpus", "numa nodes", "kernel", "thp", "irqbalance"} <= whats(topo)
    assert topo.to_json()["nodes"][0]["cpus"] == []


# --- nodes ----------------------------------------------------------------------------


def test_cpumap_when_cpulist_missing(two_node):
    two_node.remove(f"{NODE}/node1/cpulist")
    two_node.write(f"{NODE}/node1/cpumap", "00000000,000000f0")
    topo = discover(str(two_node))
    assert topo.node(1).cpus == (4, 5, 6, 7)
    assert "node 1 cpus" not in whats(topo)


def test_cpulist_and_cpumap_missing(two_node):
    two_node.remove(f"{NODE}/node1/cpulist")
    two_node.remove(f"{NODE}/node1/cpumap")
    topo = discover(str(two_node))
    assert topo.node(1).cpus == ()
    assert "node 1 cpus" in whats(topo)


def test_garbage_cpulist_falls_back_to_cpumap(two_node):
    two_node.write(f"{NODE}/node1/cpulist", "\x00\xff garbage")
    assert discover(str(two_node)).node(1).cpus == (4, 5, 6, 7)


def test_empty_cpulist_is_cpu_less_node(two_node):
    two_node.node(2, "", distance="30 30 10", mem_kb=(1048576, 1048576))
    two_node.node_lists("0-2", has_memory="0-2")
    for nid, row in ((0, "10 21 30"), (1, "21 10 30")):
        two_node.write(f"{NODE}/node{nid}/distance", row)
    topo = discover(str(two_node))
    n2 = topo.node(2)
    assert n2.cpu_less and n2.usable_cpus == () and n2.has_memory
    assert n2.distances == {0: 30, 1: 30, 2: 10}
    assert not any(u.what.startswith("node 2") for u in topo.unknowns)


def test_distance_garbage_and_wrong_width(two_node):
    two_node.write(f"{NODE}/node0/distance", "ten twenty")
    two_node.write(f"{NODE}/node1/distance", "21 10 99")
    topo = discover(str(two_node))
    assert topo.node(0).distances == {} and topo.node(1).distances == {}
    assert {"node 0 distances", "node 1 distances"} <= whats(topo)


def test_distance_columns_follow_online_order_not_lexicographic(fake):
    # node ids 0, 8, 10: a lexicographic sort ("node10" < "node8") would misplace columns
    fake.cpus("0-2")
    fake.node_lists("0,8,10")
    fake.node(0, "0", distance="10 20 30")
    fake.node(8, "1", distance="20 10 40")
    fake.node(10, "2", distance="30 40 10")
    topo = discover(str(fake))
    assert topo.node_ids == (0, 8, 10)
    assert topo.node(8).distances == {0: 20, 8: 10, 10: 40}
    assert topo.node(10).distances == {0: 30, 8: 40, 10: 10}


def test_node_online_file_wrong_falls_back_to_node_dirs(two_node):
    two_node.write(f"{NODE}/online", "0")
    topo = discover(str(two_node))
    assert topo.node(1).distances == {0: 21, 1: 10}


def test_meminfo_missing_empty_garbage(two_node):
    two_node.remove(f"{NODE}/node0/meminfo")
    two_node.write(f"{NODE}/node1/meminfo", "")
    topo = discover(str(two_node))
    assert topo.node(0).memory_total_bytes is None and topo.node(1).memory_free_bytes is None
    assert {"node 0 memory", "node 1 memory"} <= whats(topo)


def test_has_memory_and_possible_missing(two_node):
    two_node.remove(f"{NODE}/has_memory")
    two_node.remove(f"{NODE}/possible")
    two_node.node(1, "4-7", distance="21 10", mem_kb=(0, 0))
    topo = discover(str(two_node))
    assert topo.node(0).has_memory and not topo.node(1).has_memory
    assert topo.possible_nodes == (0, 1) and "possible nodes" in whats(topo)


def test_hugepages_garbage_counts(two_node):
    two_node.write(f"{NODE}/node0/hugepages/hugepages-2048kB/nr_hugepages", "lots")
    hp = discover(str(two_node)).node(0).hugepages
    assert [(h.size_kb, h.total, h.free) for h in hp] == [(2048, None, 8), (1048576, 0, 0)]


# --- cpus -----------------------------------------------------------------------------


def test_cpu_online_missing_uses_cpu_dirs(two_node):
    two_node.remove("sys/devices/system/cpu/online")
    two_node.write("sys/devices/system/cpu/cpu7/online", "0")
    two_node.write("sys/devices/system/cpu/cpu3/online", "1")
    topo = discover(str(two_node))
    assert topo.online_cpus == (0, 1, 2, 3, 4, 5, 6)
    assert topo.node(1).cpus == (4, 5, 6)
    assert "online cpus" in whats(topo)


def test_no_cpu_information_uses_node_cpus(two_node):
    import shutil

    shutil.rmtree(two_node.path / "sys/devices/system/cpu")
    topo = discover(str(two_node))
    assert topo.online_cpus == tuple(range(8)) and topo.allowed_cpus == tuple(range(8))
    assert {"online cpus", "smt siblings"} <= whats(topo)


def test_smt_siblings_and_fallbacks(two_node):
    base = "sys/devices/system/cpu/cpu{}/topology"
    two_node.remove(base.format(2) + "/thread_siblings_list")
    two_node.write(base.format(2) + "/core_cpus_list", "2-3")
    two_node.remove(base.format(5) + "/thread_siblings_list")
    topo = discover(str(two_node))
    assert topo.smt_siblings[0] == (0, 1) and topo.smt_siblings[2] == (2, 3)
    assert 5 not in topo.smt_siblings
    (u,) = [u for u in topo.unknowns if u.what == "smt siblings"]
    assert "5" in u.reason


# --- system facts -------------------------------------------------------------------------


def test_system_facts(two_node):
    two_node.write("proc/sys/kernel/osrelease", "6.8.0-1-generic\n")
    two_node.sysctl("kernel.numa_balancing", "0")
    two_node.sysctl("net.core.somaxconn", "4096")
    two_node.sysctl("net.ipv4.tcp_tw_reuse", "weird value")
    two_node.write("sys/kernel/mm/transparent_hugepage/enabled", "[always] madvise never")
    two_node.process(1, "systemd")
    two_node.process(77, "irqbalance")
    two_node.process(78, "irqbalance2")
    two_node.write("sys/fs/cgroup/cgroup.controllers", "cpuset")
    s = discover(str(two_node)).system
    assert s.kernel == "6.8.0-1-generic"
    assert s.sysctls == {
        "kernel.numa_balancing": 0,
        "net.ipv4.tcp_migrate_req": None,
        "net.core.somaxconn": 4096,
        "net.ipv4.tcp_tw_reuse": "weird value",
    }
    assert s.thp == "always"
    assert (s.irqbalance_running, s.irqbalance_pids) == (True, (77,))
    assert s.cgroup_version == 2


def test_system_facts_missing(two_node):
    two_node.write("proc/version", "garbage")
    two_node.write("sys/kernel/mm/transparent_hugepage/enabled", "always madvise never")
    two_node.sysctl("net.core.somaxconn", "")
    two_node.process(1, "systemd")
    topo = discover(str(two_node))
    s = topo.system
    assert s.kernel is None and s.thp is None and s.irqbalance_running is False
    assert all(v is None for v in s.sysctls.values())
    assert {"kernel", "thp", "sysctl net.core.somaxconn", "sysctl kernel.numa_balancing"} <= whats(topo)
    (u,) = [u for u in topo.unknowns if u.what == "sysctl net.core.somaxconn"]
    assert "empty" in u.reason


# --- garbage everywhere -----------------------------------------------------------------------


def test_garbage_everywhere_never_crashes(two_node):
    junk = b"\xff\xfe\x00\x01 -,: [garbage] 0x \n\n"
    dev = two_node.nic("eth0", "0000:02:00.0", driver="igb", local_cpulist="0-3", msi=[30, 31])
    for rel in (
        f"{NODE}/node0/cpulist", f"{NODE}/node0/cpumap", f"{NODE}/node1/distance", f"{NODE}/node1/meminfo",
        f"{NODE}/online", f"{NODE}/possible", f"{NODE}/has_memory", "sys/devices/system/cpu/online",
        "sys/devices/system/cpu/cpu1/topology/thread_siblings_list", f"{dev}/numa_node",
        f"{dev}/local_cpulist", f"{dev}/local_cpus", f"{dev}/irq", f"{dev}/class", "proc/interrupts",
        "proc/irq/30/smp_affinity_list", "proc/irq/30/smp_affinity", "proc/irq/31/effective_affinity_list",
        "proc/self/status", "proc/self/cgroup", "proc/sys/kernel/osrelease", "proc/version",
        "sys/kernel/mm/transparent_hugepage/enabled", "proc/9/comm",
    ):
        two_node.write(rel, junk)
    two_node.write(f"{dev}/msi_irqs/not-a-number", "msix")
    topo = discover(str(two_node))
    assert topo.node_ids == (0, 1) and topo.node(0).cpus == ()
    (eth0,) = topo.nics
    assert [i.irq for i in eth0.irqs] == [30, 31] and eth0.numa_node is None
    assert eth0.irqs[0].affinity is None
    assert topo.to_json()  # still serializable


def test_unreadable_directory_as_file(two_node):
    # a file where a directory is expected (and the reverse) is just "missing"
    two_node.write("proc/irq", "not a dir")
    (two_node.path / "proc/interrupts").mkdir(parents=True)
    two_node.nic("eth0", "0000:02:00.0", driver="igb", msi=[30])
    topo = discover(str(two_node))
    assert topo.nics[0].irqs[0].affinity is None and "irq names" in whats(topo)


# --- symlinks resolve inside the root -----------------------------------------------------------


def test_absolute_symlinks_resolve_inside_root(two_node):
    dev = "sys/devices/pci0000:00/0000:00:05.0"
    two_node.write(f"{dev}/numa_node", "1")
    two_node.write(f"{dev}/msi_irqs/40", "")
    (two_node.path / dev / "net/eth7").mkdir(parents=True)
    os.symlink("/" + dev, two_node.path / dev / "net/eth7/device")  # absolute, as /sys would have it
    (two_node.path / "sys/class/net").mkdir(parents=True, exist_ok=True)
    os.symlink("/" + dev + "/net/eth7", two_node.path / "sys/class/net/eth7")
    (eth7,) = discover(str(two_node)).nics
    assert (eth7.pci, eth7.numa_node, [i.irq for i in eth7.irqs]) == ("0000:00:05.0", 1, [40])


def test_resolve_clamps_dotdot_and_survives_loops(tmp_path):
    (tmp_path / "a").mkdir()
    os.symlink("../../../../etc", tmp_path / "a" / "up")
    os.symlink("loop2", tmp_path / "a" / "loop1")
    os.symlink("loop1", tmp_path / "a" / "loop2")
    fs = Root(str(tmp_path))
    assert fs.resolve("a/up") == "/etc"  # never the host's /etc: inside the root
    assert fs.host_path("a/up/passwd") == os.path.join(str(tmp_path), "etc/passwd")
    assert fs.read("a/up/passwd") is None
    fs.resolve("a/loop1/x")  # terminates
    assert fs.read("a/loop1") is None


# --- fuzz the text parsers -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("0123456789 :,-.\nCPUabcIRQedge@\t[]x")), max_size=300))
def test_parse_interrupts_never_raises(text):
    names = parse_interrupts(text)
    assert all(isinstance(k, int) for k in names)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.text(max_size=40)), st.text(min_size=1, max_size=10))
def test_classify_is_total(name, ifname):
    kind, queue = classify_irq(name, ifname)
    assert kind in ("queue", "admin", "unknown")
    assert (queue is None) or (kind == "queue" and queue >= 0)


def test_only_node_digit_dirs_are_nodes(two_node):
    for stray in ("node1x", "nodes", "node", "power", "memory12"):
        (two_node.path / NODE / stray).mkdir()
    two_node.write(f"{NODE}/node2.bak/cpulist", "0")
    assert discover(str(two_node)).node_ids == (0, 1)
