"""Slot shapes (placement.slots = node | core | l3 | gpu): plans on real hwloc dumps
(SMT: 32intel64-2p8co2t+8ve; several L3 groups: 48amd64-4pa2n6c-sparse and the
POWER9 dump; GPUs/accelerators: the POWER9 V100s and the NEC VEs) and on small
sysfs trees for what no dump has (an L3 across two nodes, NVIDIA/AMD GPUs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from numaserve.bind.placement import make_plan
from numaserve.cli.plan_cmd import plan as plan_command
from numaserve.cli.plan_cmd import slot_envs
from numaserve.config import Config, ConfigError, PlacementConfig, load_config
from numaserve.errors import UsageError
from numaserve.topology import discover

SMT = "32intel64-2p8co2t+8ve"
AMD = "48amd64-4pa2n6c-sparse"
POWER9 = "nvidiagpunumanodes"


def _plan(root: Path | str, **placement: object):
    topo = discover(str(root))
    return topo, make_plan(topo, PlacementConfig(**placement))


def _memory_is_the_slot_node(plan) -> None:
    assert all(s.memory_nodes == (s.node,) and s.mempolicy == "bind" for s in plan.slots)
    assert [s.slot for s in plan.slots] == list(range(len(plan.slots)))
    assert [s.listener for s in plan.slots] == [s.slot for s in plan.slots]


# --- core ---------------------------------------------------------------------------------------


def test_core_slots_keep_smt_siblings_together(hwloc_root) -> None:
    topo, plan = _plan(hwloc_root(SMT), slots="core")
    assert plan.shape == "core" and len(plan.slots) == 16
    assert [s.cpus for s in plan.slots[:3]] == [(0, 16), (1, 17), (2, 18)]
    assert plan.slots[8].node == 1 and plan.slots[8].cpus == (8, 24) and plan.slots[8].index == 0
    assert [s.index for s in plan.slots if s.node == 0] == list(range(8))
    _memory_is_the_slot_node(plan)


def test_core_slots_on_sparse_node_ids(hwloc_root) -> None:
    _, plan = _plan(hwloc_root(AMD), slots="core")
    assert len(plan.slots) == 48 and all(len(s.cpus) == 1 for s in plan.slots)
    assert {s.node for s in plan.slots} == {0, 1, 2, 33, 34, 45, 72, 73}
    assert [s.cpus for s in plan.slots if s.node == 45] == [(c,) for c in range(30, 36)]
    _memory_is_the_slot_node(plan)


def test_core_slots_leave_irq_cores_out(two_node) -> None:
    two_node.nic("eth0", "0000:01:00.0", driver="igb", numa_node=1, local_cpulist="4-7")
    _, plan = _plan(two_node.path, slots="core", reserve_irq_cpus=1)
    assert [s.cpus for s in plan.slots] == [(0, 1), (2, 3), (4, 5)]
    assert plan.irq_cpus == {1: (6, 7)}


# --- l3 -----------------------------------------------------------------------------------------


def test_l3_slots_follow_the_cache_groups(hwloc_root) -> None:
    _, plan = _plan(hwloc_root(AMD), slots="l3")  # one 6-core L3 per node (Magny-Cours die)
    assert [s.cpus for s in plan.slots] == [tuple(range(i, i + 6)) for i in range(0, 48, 6)]
    _memory_is_the_slot_node(plan)
    _, plan = _plan(hwloc_root(POWER9), slots="l3")  # POWER9: an L3 per pair of SMT4 cores
    assert [(s.node, s.cpus) for s in plan.slots] == [(0, tuple(range(0, 8))), (0, tuple(range(8, 16)))]
    _, plan = _plan(hwloc_root(SMT), slots="l3")  # Intel: one L3 per socket = per node
    assert [s.cpus for s in plan.slots] == [(*range(0, 8), *range(16, 24)), (*range(8, 16), *range(24, 32))]


def _l3(fake, group: str) -> None:
    from numaserve.cpulist import parse_list

    for c in parse_list(group):
        base = f"sys/devices/system/cpu/cpu{c}/cache/index3"
        fake.write(f"{base}/level", "3")
        fake.write(f"{base}/shared_cpu_list", group)


def test_l3_groups_within_a_node_and_cut_at_the_node(two_node) -> None:
    _l3(two_node, "0-1")
    _l3(two_node, "2-3")
    _l3(two_node, "4-7")  # node 1: one L3
    _, plan = _plan(two_node.path, slots="l3")
    assert [(s.node, s.cpus) for s in plan.slots] == [(0, (0, 1)), (0, (2, 3)), (1, (4, 5, 6, 7))]
    _l3(two_node, "0-7")  # one L3 across both nodes (sub-NUMA clustering): one slot per node
    _, plan = _plan(two_node.path, slots="l3")
    assert [(s.node, s.cpus) for s in plan.slots] == [(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))]


def test_l3_without_cache_information_is_a_clear_error(two_node) -> None:
    with pytest.raises(UsageError, match=r'slots = "l3": no L3 cache information for CPU\(s\) 0-3 of node 0'):
        _plan(two_node.path, slots="l3")


# --- gpu ----------------------------------------------------------------------------------------


def test_gpu_slots_on_the_power9_dump(hwloc_root) -> None:
    topo, plan = _plan(hwloc_root(POWER9), slots="gpu")
    assert [(s.node, s.gpus) for s in plan.slots] == [
        (0, ("0004:05:00.0",)), (0, ("0004:06:00.0",)), (0, ("0006:00:00.0",))]
    assert [s.cpus for s in plan.slots] == [tuple(range(0, 8)), tuple(range(8, 12)), tuple(range(12, 16))]
    _memory_is_the_slot_node(plan)
    # node 8's V100s: the node is outside the cgroup cpuset, and the plan says so
    assert any("0007:00:00.0 gets no slot: its node 8: no usable CPUs" in n for n in plan.notes)


def test_gpu_slots_on_the_nec_vector_engines(hwloc_root) -> None:
    _, plan = _plan(hwloc_root(SMT), slots="gpu")
    assert len(plan.slots) == 8 and {s.node for s in plan.slots} == {0}
    assert all(len(s.gpus) == 1 for s in plan.slots) and len({s.gpus for s in plan.slots}) == 8
    assert plan.slots[0].cpus == (0, 16)  # one core each
    assert [(k.node, k.reason) for k in plan.skipped] == [(1, 'no GPU (slots = "gpu")')]


def _gpus(fake) -> None:
    fake.two_nodes()
    fake.pci("0000:03:00.0", pci_class="0x030000", vendor="0x1a03", numa_node=0)  # ASPEED BMC VGA
    fake.pci("0000:41:00.0", pci_class="0x030200", vendor="0x10de", numa_node=0, driver="nvidia")
    fake.pci("0000:81:00.0", pci_class="0x030200", vendor="0x10de", numa_node=1, driver="nvidia")
    fake.pci("0000:c1:00.0", pci_class="0x038000", vendor="0x1002", numa_node=1, driver="amdgpu")


def test_gpu_slots_see_their_gpu_alone(fake) -> None:
    _gpus(fake)
    topo, plan = _plan(fake.path, slots="gpu")
    assert [(s.node, s.gpus, s.cpus) for s in plan.slots] == [
        (0, ("0000:41:00.0",), (0, 1, 2, 3)),
        (1, ("0000:81:00.0",), (4, 5)),
        (1, ("0000:c1:00.0",), (6, 7)),
    ]
    envs = slot_envs(Config(), plan, topo)
    assert envs[0]["CUDA_VISIBLE_DEVICES"] == "0" and envs[0]["ROCR_VISIBLE_DEVICES"] == ""
    assert envs[1]["CUDA_VISIBLE_DEVICES"] == "1" and envs[1]["ROCR_VISIBLE_DEVICES"] == ""
    assert envs[2]["CUDA_VISIBLE_DEVICES"] == "" and envs[2]["ROCR_VISIBLE_DEVICES"] == "0"
    assert envs[0]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    # cpu_split = "shared": every GPU slot of a node may run on all its CPUs
    _, shared = _plan(fake.path, slots="gpu", cpu_split="shared")
    assert [s.cpus for s in shared.slots] == [(0, 1, 2, 3), (4, 5, 6, 7), (4, 5, 6, 7)]


def test_gpu_slots_without_a_compute_gpu(two_node) -> None:
    two_node.pci("0000:03:00.0", pci_class="0x030000", vendor="0x1a03", numa_node=0)
    with pytest.raises(UsageError, match=r'slots = "gpu": this machine has no compute GPU .*0x1a03, display only'):
        _plan(two_node.path, slots="gpu")
    with pytest.raises(UsageError, match=r"node 1 cannot be used: no GPU"):
        two_node.pci("0000:41:00.0", pci_class="0x030200", vendor="0x10de", numa_node=0)
        make_plan(discover(str(two_node.path)), PlacementConfig(slots="gpu", nodes="0,1"))


# --- the rules between settings -----------------------------------------------------------------


def test_node_shape_is_today_and_the_default(hwloc_root) -> None:
    _, plan = _plan(hwloc_root(SMT))
    assert plan.shape == "node" and [s.cpus for s in plan.slots] == [
        (*range(0, 8), *range(16, 24)), (*range(8, 16), *range(24, 32))]
    _, plan = _plan(hwloc_root(SMT), workers_per_node=2)
    assert len(plan.slots) == 4


@pytest.mark.parametrize("shape", ["core", "l3", "gpu"])
def test_other_shapes_refuse_workers_per_node(two_node, shape: str) -> None:
    topo = discover(str(two_node.path))
    for wpn in (2, "auto"):
        with pytest.raises(UsageError, match=f'applies to slots = "node" only: slots = "{shape}"'):
            make_plan(topo, PlacementConfig(slots=shape, workers_per_node=wpn))


def test_core_and_l3_refuse_shared_cpus(two_node) -> None:
    with pytest.raises(UsageError, match='cpu_split = "shared" does not apply to slots = "core"'):
        _plan(two_node.path, slots="core", cpu_split="shared")


def test_config_key_names_the_bad_value(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[placement]\nslots = "socket"\n')
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    msg = str(e.value)
    assert "placement.slots" in msg and "socket" in msg and "\n" not in msg
    p.write_text('[placement]\nslots = "core"\n')
    assert load_config(p, environ={}).placement.slots == "core"


def test_plan_cli_slots_flag(two_node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("NUMASERVE_")]:
        monkeypatch.delenv(name)
    cfg = tmp_path / "empty.toml"
    cfg.write_text("")
    run = CliRunner().invoke(plan_command, ["--config", str(cfg), "--root", str(two_node.path), "--slots", "core",
                                            "--json"], catch_exceptions=False)
    data = json.loads(run.output)
    assert data["shape"] == "core" and [s["cpus"] for s in data["slots"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    run = CliRunner().invoke(plan_command, ["--config", str(cfg), "--root", str(two_node.path), "--slots", "core",
                                            "--no-json"], catch_exceptions=False)
    assert "4 slot(s) on node(s) 0,1 (slots=core: one per physical core" in run.output
    run = CliRunner().invoke(plan_command, ["--config", str(cfg), "--root", str(two_node.path), "--slots", "core",
                                            "--workers-per-node", "2"])
    assert isinstance(run.exception, UsageError) and 'applies to slots = "node" only' in str(run.exception)


def test_gpu_slot_whose_vendor_has_no_visibility_variable_is_noted(hwloc_root) -> None:
    _, plan = _plan(hwloc_root(POWER9), slots="gpu")  # the dump has no PCI vendor files
    assert any(n.startswith("slot 0: GPU 0004:05:00.0 (vendor unknown): no visibility variable") for n in plan.notes)
