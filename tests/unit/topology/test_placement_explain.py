"""`numaserve plan --explain` and doctor: every reason a CPU or node is used or
skipped, and every host setting that works against the binding, each on a real
hwloc dump or a small sysfs tree that has it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from numaserve.bind.placement import make_plan
from numaserve.cli.plan_cmd import plan as plan_command
from numaserve.config import Config, PlacementConfig
from numaserve.net.irq import IrqSettings
from numaserve.tools.doctor import run_checks
from numaserve.bind.explain import Finding, cpu_findings, node_findings
from numaserve.tools.explain import explain, hazards
from numaserve.topology import discover
from numaserve.topology.cpufacts import cmdline_cpus




def _by_subject(findings: list[Finding]) -> dict[str, Finding]:
    return {f.subject: f for f in findings}


def _explain(root: Path | str, config: Config | None = None) -> tuple[dict[str, Finding], list[Finding]]:
    cfg = config or Config()
    topo = discover(str(root))
    plan = make_plan(topo, cfg.placement)
    return _by_subject(cpu_findings(topo, plan) + node_findings(topo, plan)), hazards(topo, cfg)


def _doctor(root: Path | str, config: Config | None = None) -> dict[str, str]:
    cfg = config or Config()
    return {c.id: c.verdict for c in run_checks(discover(str(root)), cfg)}


# --- CPUs and nodes ---------------------------------------------------------------------------


def test_cgroup_forbidden_cpus_and_memory_only_nodes_on_the_power9_dump(hwloc_root) -> None:
    root = hwloc_root("nvidiagpunumanodes")
    f, hz = _explain(root)
    assert f["cpu 3"].verdict == "used" and f["cpu 3"].reason == "slot 0 (node 0)"
    assert f["cpu 90"].verdict == "skipped" and "cgroup cpuset" in f["cpu 90"].reason
    assert f["node 8"].verdict == "skipped" and "no usable CPUs" in f["node 8"].reason
    assert f["node 251"].verdict == "skipped" and "memory-only" in f["node 251"].reason
    mem = {h.subject: h for h in hz}["memory_nodes"]
    assert mem.verdict == "info" and "250-255" in mem.reason
    assert _doctor(root)["memory_nodes"] == "info"


def test_sub_numa_clustering_on_the_magny_cours_dump(hwloc_root) -> None:
    root = hwloc_root("48amd64-4pa2n6c-sparse")
    _, hz = _explain(root)
    snc = {h.subject: h for h in hz}["sub_numa"]
    assert snc.verdict == "warn" and "socket 0: nodes 0-1" in snc.reason and "socket 1: nodes 2,33" in snc.reason
    assert _doctor(root)["sub_numa"] == "warn"
    # one node per socket: nothing to say
    assert _doctor(hwloc_root("32intel64-2p8co2t+8ve"))["sub_numa"] == "ok"


def test_offline_cpu(fake) -> None:
    fake.two_nodes()
    fake.write("sys/devices/system/cpu/present", "0-8")  # cpu 8 present but not online
    f, _ = _explain(fake.path)
    assert f["cpu 8"].verdict == "skipped" and f["cpu 8"].reason.startswith("offline")
    assert f["cpu 7"].verdict == "used"


def test_isolated_cpus_are_skipped_by_placement_and_explained(fake) -> None:
    fake.two_nodes()
    fake.write("sys/devices/system/cpu/isolated", "2-3")
    fake.write("proc/cmdline", "ro quiet isolcpus=domain,managed_irq,6 nohz_full=4-5")
    topo = discover(str(fake.path))
    assert topo.cpu_facts.isolated == (2, 3, 6) and topo.cpu_facts.nohz_full == (4, 5)
    plan = make_plan(topo, PlacementConfig())
    assert plan.slots[0].cpus == (0, 1) and plan.slots[1].cpus == (4, 5, 7)
    f = _by_subject(cpu_findings(topo, plan))
    assert f["cpu 2"].verdict == "skipped" and "isolcpus" in f["cpu 2"].reason
    assert f["cpu 6"].verdict == "skipped" and "isolcpus" in f["cpu 6"].reason
    assert f["cpu 4"].verdict == "used" and "nohz_full" in f["cpu 4"].reason
    checks = {c.id: c for c in run_checks(topo, Config())}
    assert checks["isolated_cpus"].verdict == "info" and "2-3,6" in checks["isolated_cpus"].summary


def test_node_with_only_isolated_cpus_is_skipped(fake) -> None:
    fake.two_nodes()
    fake.write("sys/devices/system/cpu/isolated", "4-7")
    topo = discover(str(fake.path))
    plan = make_plan(topo, PlacementConfig())
    assert [s.node for s in plan.slots] == [0]
    f = _by_subject(node_findings(topo, plan))
    assert f["node 1"].verdict == "skipped" and "all isolated" in f["node 1"].reason


def test_cmdline_cpus() -> None:
    assert cmdline_cpus("isolcpus=nohz,domain,managed_irq,2-5 x", "isolcpus") == (2, 3, 4, 5)
    assert cmdline_cpus("isolcpus=1,3", "isolcpus") == (1, 3)
    assert cmdline_cpus("nohz_full=4-5 isolcpus=junk", "isolcpus") == ()
    assert cmdline_cpus("ro -- isolcpus=3", "isolcpus") == ()  # after "--": init's arguments
    assert cmdline_cpus("ro", "nohz_full") == ()


def test_smt_sibling_left_out_by_the_cpuset(fake) -> None:
    fake.two_nodes()  # cores 0-1, 2-3, 4-5, 6-7
    fake.status(cpus="0,2-7")  # CPU 1 (sibling of 0) forbidden
    f, _ = _explain(fake.path)
    why = f["cpu 1"].reason
    assert f["cpu 1"].verdict == "skipped" and "SMT sibling of CPU 0" in why and "slot 0" in why
    assert f["cpu 0"].verdict == "used"


def test_memory_less_node(fake) -> None:
    fake.cpus("0-3", ["0", "1", "2", "3"])
    fake.node_lists("0-1", has_memory="0")
    fake.node(0, "0-1", distance="10 21")
    fake.node(1, "2-3", distance="21 10", mem_kb=(0, 0))
    f, hz = _explain(fake.path)
    assert f["node 1"].verdict == "skipped" and "no memory" in f["node 1"].reason
    assert f["cpu 2"].verdict == "skipped" and "node 1 skipped" in f["cpu 2"].reason
    mem = {h.subject: h for h in hz}["memory_nodes"]
    assert mem.verdict == "warn" and "node(s) 1 have CPUs but no memory" in mem.reason
    # with mempolicy local the node runs a worker, and the node finding says what it costs
    f, _ = _explain(fake.path, Config(placement=PlacementConfig(mempolicy="local")))
    assert f["node 1"].verdict == "used" and "every access is remote" in f["node 1"].reason


def test_reserved_irq_cpus_explained(fake) -> None:
    fake.two_nodes()
    fake.nic("eth0", "0000:01:00.0", driver="igb", numa_node=1, local_cpulist="4-7")
    f, _ = _explain(fake.path, Config(placement=PlacementConfig(reserve_irq_cpus=1)))
    assert f["cpu 6"].verdict == "skipped" and "reserved for NIC IRQs of node 1" in f["cpu 6"].reason


def test_not_requested_node(fake) -> None:
    fake.two_nodes()
    f, _ = _explain(fake.path, Config(placement=PlacementConfig(nodes="0")))
    assert f["node 1"].verdict == "skipped" and "not requested" in f["node 1"].reason
    assert "not requested" in f["cpu 5"].reason


# --- host settings against the binding --------------------------------------------------------


def test_numa_balancing_on(fake) -> None:
    fake.two_nodes()
    fake.sysctl("kernel.numa_balancing", "1")
    _, hz = _explain(fake.path)
    nb = {h.subject: h for h in hz}["numa_balancing"]
    assert nb.verdict == "warn" and "kernel.numa_balancing = 1" in nb.reason
    fake.sysctl("kernel.numa_balancing", "0")
    assert "numa_balancing" not in {h.subject for h in _explain(fake.path)[1]}


def test_irqbalance_while_an_irq_plan_is_applied(fake) -> None:
    fake.two_nodes()
    fake.nic("eth0", "0000:01:00.0", driver="igb", numa_node=1, local_cpulist="4-7", msi=(40,))
    fake.process(812, "irqbalance")
    fake.process(1, "systemd")
    cfg = Config(irq=IrqSettings(apply_at_start=True))
    _, hz = _explain(fake.path, cfg)
    ib = {h.subject: h for h in hz}["irqbalance"]
    assert ib.verdict == "fail" and "pid 812" in ib.reason and "apply_at_start" in ib.reason
    assert _doctor(fake.path, cfg)["irqbalance"] == "fail"


def test_thp_settings(fake) -> None:
    fake.two_nodes()
    base = "sys/kernel/mm/transparent_hugepage"
    fake.write(f"{base}/enabled", "[always] madvise never")
    fake.write(f"{base}/defrag", "always defer defer+madvise [madvise] never")
    fake.write(f"{base}/khugepaged/defrag", "1")
    hz = {h.subject: h for h in _explain(fake.path)[1]}
    assert hz["thp"].verdict == "warn"
    assert hz["thp_defrag"].verdict == "info" and "khugepaged" in hz["thp_defrag"].reason
    pref = Config(placement=PlacementConfig(mempolicy="preferred"))
    assert {h.subject: h for h in _explain(fake.path, pref)[1]}["thp_defrag"].verdict == "warn"
    fake.write(f"{base}/defrag", "[always] defer defer+madvise madvise never")
    hz = {h.subject: h for h in _explain(fake.path)[1]}
    assert hz["thp_defrag"].verdict == "warn" and "direct compaction" in hz["thp_defrag"].reason
    assert _doctor(fake.path)["thp_defrag"] == "warn"
    fake.write(f"{base}/enabled", "always madvise [never]")
    assert "thp_defrag" not in {h.subject for h in _explain(fake.path)[1]}


# --- the CLI ----------------------------------------------------------------------------------


def _cli(args: list[str], tmp_path: Path) -> tuple[int, str]:
    cfg = tmp_path / "empty.toml"
    cfg.write_text("")
    r = CliRunner().invoke(plan_command, [*args, "--config", str(cfg)], catch_exceptions=False)
    return r.exit_code, r.output


def test_plan_explain_cli_text_and_json(fake, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in __import__("os").environ if n.startswith("NUMASERVE_")]:
        monkeypatch.delenv(name)
    fake.two_nodes()
    fake.write("sys/devices/system/cpu/isolated", "3")
    fake.sysctl("kernel.numa_balancing", "1")
    code, out = _cli(["--root", str(fake.path), "--explain", "--no-json"], tmp_path)
    assert code == 0, out
    assert "why each CPU and node is used or skipped:" in out
    assert "cpu 3" in out and "isolated (isolcpus)" in out
    assert "numa_balancing" in out and "works against the binding" in out
    code, out = _cli(["--root", str(fake.path), "--explain", "--json"], tmp_path)
    data = json.loads(out)
    subjects = {e["subject"]: e for e in data["explain"]}
    assert subjects["cpu 3"]["verdict"] == "skipped" and subjects["node 0"]["verdict"] == "used"
    assert subjects["numa_balancing"]["verdict"] == "warn"
    code, out = _cli(["--root", str(fake.path), "--json"], tmp_path)
    assert "explain" not in json.loads(out)  # only when asked


def test_explain_folds_cpu_runs(hwloc_root) -> None:
    root = hwloc_root("40intel64-2g2n4c+pcilocality")
    topo = discover(str(root))
    out = _by_subject(explain(topo, make_plan(topo, PlacementConfig()), Config()))
    assert out["cpus 0,4,8,12,16,20,24,28,32,36"].reason == "slot 0 (node 0)"


def test_doctor_sums_up_the_cpus_without_a_worker(fake) -> None:
    fake.two_nodes()  # cores 0-1, 2-3, 4-5, 6-7
    fake.write("sys/devices/system/cpu/present", "0-8")  # cpu 8 offline
    fake.write("sys/devices/system/cpu/isolated", "7")
    topo = discover(str(fake.path))
    checks = {c.id: c for c in run_checks(topo, Config())}
    c = checks["placement"]
    assert c.verdict == "info" and "cpu 8 (offline" in c.summary and "cpu 7 (isolated" in c.summary
    fake.status(cpus="0,2-8")  # CPU 1, sibling of CPU 0, forbidden
    checks = {c.id: c for c in run_checks(discover(str(fake.path)), Config())}
    c = checks["placement"]
    assert c.verdict == "warn" and "cpu 1 left out of half-allowed cores" in c.summary
    assert "cpu 1: SMT sibling of CPU 0 left out" in c.detail and "AllowedCPUs" in c.fix
    assert {x.id: x for x in run_checks(discover(str(fake.path)), Config())}["cpuset"].verdict == "warn"


def test_doctor_fails_a_placement_start_would_refuse(fake) -> None:
    fake.two_nodes()  # no L3 cache information in this tree
    c = {x.id: x for x in run_checks(discover(str(fake.path)), Config(placement=PlacementConfig(slots="l3")))}
    assert c["placement"].verdict == "fail" and 'slots = "l3": no L3 cache information' in c["placement"].summary
    c = {x.id: x for x in run_checks(discover(str(fake.path)), Config())}
    assert c["placement"].verdict == "ok" and "every usable CPU has a slot" in c["placement"].summary


def test_declared_pretend_nodes_on_one_memory_node_are_not_sub_numa(fake, tmp_path: Path) -> None:
    fake.two_nodes()
    for c in range(8):
        fake.write(f"sys/devices/system/cpu/cpu{c}/topology/physical_package_id", "0")
    assert _doctor(fake.path)["sub_numa"] == "warn"  # two real nodes in socket 0
    decl = tmp_path / "topo.toml"
    decl.write_text('mode = "replace"\n[[node]]\nid = 0\ncpus = "0-1"\nmemory_node = 0\n'
                    '[[node]]\nid = 1\ncpus = "2-3"\nmemory_node = 0\n')
    topo = discover(str(fake.path), declared=str(decl))
    assert {c.id: c for c in run_checks(topo, Config())}["sub_numa"].verdict == "ok"
