"""make_plan on hand-built Topology objects: node selection, CPU split, IRQ cores, memory, GPUs."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from numaserve.config import PlacementConfig
from numaserve.errors import UsageError
from numaserve.bind.placement import (
    Plan,
    SlotPlan,
    make_plan,
    parse_workers_per_node,
    physical_cores,
    reserved_irq_cpus,
    split_cpus,
)
from numaserve.topology.model import Gpu, Nic, Node, Topology

# --- builders ----------------------------------------------------------------------


def mknode(
    nid: int,
    cpus: list[int] | range,
    *,
    usable: list[int] | range | None = None,
    memory_node: int | None = None,
    has_memory: bool = True,
) -> Node:
    cpus = tuple(cpus)
    return Node(
        id=nid,
        cpus=cpus,
        usable_cpus=cpus if usable is None else tuple(usable),
        memory_total_bytes=1 << 30 if has_memory else 0,
        memory_free_bytes=1 << 29 if has_memory else 0,
        has_memory=has_memory,
        memory_node=memory_node,
    )


def mktopo(
    nodes: list[Node],
    *,
    smt: dict[int, tuple[int, ...]] | None = None,
    nics: list[Nic] | None = None,
    gpus: list[Gpu] | None = None,
    allowed_mems: tuple[int, ...] | None = None,
    declared: str | None = None,
) -> Topology:
    online = tuple(sorted(c for n in nodes for c in n.cpus))
    allowed = tuple(sorted(c for n in nodes for c in n.usable_cpus))
    mems = tuple(sorted(n.id for n in nodes if n.has_memory)) if allowed_mems is None else allowed_mems
    return Topology(
        root="/test",
        nodes=list(nodes),
        online_cpus=online,
        allowed_cpus=allowed,
        allowed_mems=mems,
        possible_nodes=tuple(sorted(n.id for n in nodes)),
        smt_siblings=smt or {},
        nics=nics or [],
        gpus=gpus or [],
        declared=declared,
    )


def smt_pairs(ncpus: int) -> dict[int, tuple[int, ...]]:
    """Linux x86 numbering: CPU c and c + ncpus/2 are siblings of one core."""
    half = ncpus // 2
    out = {}
    for c in range(half):
        out[c] = out[c + half] = (c, c + half)
    return out


def nic(name: str, node: int | None) -> Nic:
    return Nic(
        name=name, driver="ixgbe", pci=None, numa_node=node, numa_node_source="sysfs",
        local_cpus=(), rx_queues=8, tx_queues=8,
    )


def gpu(pci: str, node: int | None) -> Gpu:
    return Gpu(pci=pci, vendor="0x10de", device="0x20b0", pci_class="0x030200", driver="nvidia", numa_node=node)


def two_nodes() -> Topology:
    """2 sockets x 4 cores, no SMT: node 0 = 0-3, node 1 = 4-7."""
    return mktopo([mknode(0, range(0, 4)), mknode(1, range(4, 8))])


def two_nodes_smt() -> Topology:
    """2 sockets x 8 cores x 2 threads: node 0 = 0-7,16-23, node 1 = 8-15,24-31."""
    n0 = mknode(0, [*range(0, 8), *range(16, 24)])
    n1 = mknode(1, [*range(8, 16), *range(24, 32)])
    return mktopo([n0, n1], smt=smt_pairs(32))


def cfg(**kw: object) -> PlacementConfig:
    return PlacementConfig(**kw)  # type: ignore[arg-type]


def cpus_of(plan: Plan) -> list[tuple[int, ...]]:
    return [s.cpus for s in plan.slots]


# --- basics ----------------------------------------------------------------------


def test_two_nodes_one_worker_each() -> None:
    plan = make_plan(two_nodes(), cfg())
    assert [(s.slot, s.node, s.index, s.listener) for s in plan.slots] == [(0, 0, 0, 0), (1, 1, 0, 1)]
    assert cpus_of(plan) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [s.memory_nodes for s in plan.slots] == [(0,), (1,)]
    assert all(s.mempolicy == "bind" for s in plan.slots)
    assert plan.skipped == [] and plan.notes == []
    assert plan.nodes == (0, 1)


def test_two_workers_per_node_numbered_globally() -> None:
    plan = make_plan(two_nodes(), cfg(workers_per_node=2))
    assert [(s.slot, s.node, s.index) for s in plan.slots] == [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    assert [s.listener for s in plan.slots] == [0, 1, 2, 3]
    assert cpus_of(plan) == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_plan_json_contract() -> None:
    data = make_plan(two_nodes(), cfg(workers_per_node=2)).to_json()
    assert set(data) >= {"slots", "skipped", "notes", "mempolicy", "workers_per_node"}
    s = data["slots"][1]
    assert s == {
        "slot": 1, "node": 0, "index": 1, "cpus": [2, 3], "mempolicy": "bind",
        "memory_nodes": [0], "gpus": [], "listener": 1,
    }
    assert data["workers_per_node"] == 2


def test_make_plan_is_pure() -> None:
    topo = two_nodes_smt()
    topo.nics.append(nic("eth0", 0))
    before = copy.deepcopy(topo.to_json())
    make_plan(topo, cfg(workers_per_node="auto", reserve_irq_cpus=2))
    assert topo.to_json() == before


def test_explicit_arguments_override_config() -> None:
    plan = make_plan(two_nodes(), cfg(nodes="0", workers_per_node=1), nodes="1", workers_per_node="2")
    assert [(s.node, s.cpus) for s in plan.slots] == [(1, (4, 5)), (1, (6, 7))]
    plan = make_plan(two_nodes(), cfg(), nodes=[1, 0, 1])
    assert plan.nodes == (0, 1)


# --- node selection ---------------------------------------------------------------


SPARSE = (0, 1, 2, 33, 34, 45, 72, 73)


def sparse_topo() -> Topology:
    # given out of order on purpose: slots must follow numeric node order
    nodes = [mknode(nid, range(6 * i, 6 * i + 6)) for i, nid in enumerate(SPARSE)]
    return mktopo([nodes[i] for i in (3, 0, 7, 1, 5, 2, 6, 4)])


def test_sparse_node_ids_all() -> None:
    plan = make_plan(sparse_topo(), cfg())
    assert tuple(s.node for s in plan.slots) == SPARSE
    assert [s.slot for s in plan.slots] == list(range(8))
    assert [s.memory_nodes for s in plan.slots] == [(n,) for n in SPARSE]
    assert plan.slots[3].cpus == tuple(range(18, 24))


def test_sparse_node_ids_explicit_list() -> None:
    plan = make_plan(sparse_topo(), cfg(nodes="0,33,72-73"))
    assert [s.node for s in plan.slots] == [0, 33, 72, 73]


def test_nonexistent_node_message() -> None:
    with pytest.raises(UsageError) as e:
        make_plan(two_nodes(), cfg(nodes="5"))
    assert str(e.value) == "node 5 does not exist; nodes on this machine: 0,1; usable: 0,1"


def test_nonexistent_sparse_node_lists_compactly() -> None:
    with pytest.raises(UsageError, match=r"node 3 does not exist; nodes on this machine: 0-2,33,34,45,72,73; usable: 0-2,33,34,45,72,73$"):
        make_plan(sparse_topo(), cfg(nodes="0,3"))


def gpu_machine() -> Topology:
    """POWER9 + V100 shape: CPU nodes 0 and 8, GPU memory nodes 250-255."""
    nodes = [mknode(0, range(0, 4)), mknode(8, range(4, 8))]
    nodes += [mknode(n, []) for n in range(250, 256)]
    return mktopo(nodes)


def test_cpu_less_nodes_skipped_with_reason() -> None:
    plan = make_plan(gpu_machine(), cfg())
    assert [s.node for s in plan.slots] == [0, 8]
    assert [s.node for s in plan.skipped] == list(range(250, 256))
    assert all(s.reason == "no CPUs (memory-only node)" for s in plan.skipped)
    assert plan.to_json()["skipped"][0] == {"node": 250, "reason": "no CPUs (memory-only node)"}


def test_explicit_cpu_less_node_is_an_error() -> None:
    with pytest.raises(UsageError) as e:
        make_plan(gpu_machine(), cfg(nodes="0,250"))
    msg = str(e.value)
    assert "node 250" in msg and "memory-only" in msg and "usable nodes: 0,8" in msg


def cgroup_narrowed() -> Topology:
    """Node 1's CPUs exist but the cgroup cpuset allows only node 0's."""
    return mktopo([mknode(0, range(0, 4)), mknode(1, range(4, 8), usable=[])])


def test_cgroup_forbidden_node_skipped_under_all() -> None:
    plan = make_plan(cgroup_narrowed(), cfg())
    assert [s.node for s in plan.slots] == [0]
    (skip,) = plan.skipped
    assert skip.node == 1
    assert "no usable CPUs" in skip.reason and "4-7" in skip.reason and "allowed CPUs: 0-3" in skip.reason


def test_cgroup_forbidden_node_explicit_is_an_error() -> None:
    with pytest.raises(UsageError) as e:
        make_plan(cgroup_narrowed(), cfg(nodes="1"))
    msg = str(e.value)
    assert msg.startswith("node 1 cannot be used")
    assert "allowed CPUs: 0-3" in msg and "usable nodes: 0" in msg


def test_partially_allowed_node_uses_only_usable_cpus() -> None:
    topo = mktopo([mknode(0, range(0, 8), usable=range(2, 6))])
    plan = make_plan(topo, cfg(workers_per_node=2))
    assert cpus_of(plan) == [(2, 3), (4, 5)]


def test_no_slot_at_all_is_an_error() -> None:
    topo = mktopo([mknode(0, range(4), usable=[]), mknode(1, [])])
    with pytest.raises(UsageError, match=r"no node can take workers: node 0: no usable CPUs.*node 1: no CPUs"):
        make_plan(topo, cfg())


@pytest.mark.parametrize("spec", ["x", "0-", "3-1", "", "0,,1", "-1"])
def test_bad_node_spec(spec: str) -> None:
    with pytest.raises(UsageError, match="node spec"):
        make_plan(two_nodes(), cfg(), nodes=spec)


@pytest.mark.parametrize("value", [0, -1, "x", "0", "-1", "1.5", True, ""])
def test_bad_workers_per_node(value: object) -> None:
    with pytest.raises(UsageError, match='expected an integer >= 1 or "auto"'):
        make_plan(two_nodes(), cfg(), workers_per_node=value)  # type: ignore[arg-type]


def test_parse_workers_per_node() -> None:
    assert parse_workers_per_node("auto") == "auto"
    assert parse_workers_per_node(" AUTO ") == "auto"
    assert parse_workers_per_node("3") == 3
    assert parse_workers_per_node(2) == 2


# --- CPU split ---------------------------------------------------------------------


def test_smt_siblings_stay_in_one_slot() -> None:
    plan = make_plan(two_nodes_smt(), cfg(workers_per_node=2))
    assert cpus_of(plan) == [
        (0, 1, 2, 3, 16, 17, 18, 19),
        (4, 5, 6, 7, 20, 21, 22, 23),
        (8, 9, 10, 11, 24, 25, 26, 27),
        (12, 13, 14, 15, 28, 29, 30, 31),
    ]


def test_remainder_goes_one_core_to_first_slots() -> None:
    topo = mktopo([mknode(0, range(5))])
    assert cpus_of(make_plan(topo, cfg(workers_per_node=2))) == [(0, 1, 2), (3, 4)]
    topo = mktopo([mknode(0, [*range(0, 5), *range(8, 13)])], smt={c: (c, c + 8) for c in range(5)} | {c + 8: (c, c + 8) for c in range(5)})
    assert cpus_of(make_plan(topo, cfg(workers_per_node=3))) == [(0, 1, 8, 9), (2, 3, 10, 11), (4, 12)]


def test_auto_is_physical_cores_without_gpus() -> None:
    plan = make_plan(two_nodes_smt(), cfg(workers_per_node="auto"))
    assert len(plan.slots) == 16
    assert plan.slots[0].cpus == (0, 16)
    assert plan.slots[7].cpus == (7, 23)
    assert plan.slots[8].cpus == (8, 24)
    assert plan.workers_per_node == "auto"
    assert any("node 0: workers_per_node auto = 8 (one per physical core)" in n for n in plan.notes)


def test_auto_counts_only_usable_cores() -> None:
    # cgroup allows only 0-2 and sibling 16: 3 cores
    topo = two_nodes_smt()
    topo.nodes[0].usable_cpus = (0, 1, 2, 16)
    plan = make_plan(topo, cfg(workers_per_node="auto", nodes="0"))
    assert cpus_of(plan) == [(0, 16), (1,), (2,)]


def test_more_workers_than_cores_splits_threads() -> None:
    topo = mktopo([mknode(0, range(8))], smt=smt_pairs(8))  # 4 cores: (0,4) (1,5) (2,6) (3,7)
    plan = make_plan(topo, cfg(workers_per_node=6))
    assert cpus_of(plan) == [(0, 4), (1, 5), (2,), (6,), (3,), (7,)]
    assert any("6 workers > 4 physical cores" in n for n in plan.notes)
    assert sorted(c for s in plan.slots for c in s.cpus) == list(range(8))


def test_more_workers_than_cpus_share_round_robin() -> None:
    topo = mktopo([mknode(0, range(3))])
    plan = make_plan(topo, cfg(workers_per_node=5))
    assert cpus_of(plan) == [(0,), (1,), (2,), (0,), (1,)]
    assert any("5 workers > 3 usable CPUs" in n and "share a CPU" in n for n in plan.notes)


def test_shared_cpu_split() -> None:
    plan = make_plan(two_nodes(), cfg(workers_per_node=3, cpu_split="shared"))
    assert cpus_of(plan) == [(0, 1, 2, 3)] * 3 + [(4, 5, 6, 7)] * 3
    assert plan.to_json()["cpu_split"] == "shared"


def test_physical_cores_grouping() -> None:
    topo = two_nodes_smt()
    assert physical_cores(topo, [0, 16, 1, 17, 2]) == [(0, 16), (1, 17), (2,)]
    assert physical_cores(mktopo([mknode(0, range(3))]), [2, 0, 1]) == [(0,), (1,), (2,)]


@settings(max_examples=150, deadline=None)
@given(
    cores=st.integers(min_value=1, max_value=24),
    threads=st.integers(min_value=1, max_value=4),
    n=st.integers(min_value=1, max_value=40),
    base=st.integers(min_value=0, max_value=200),
)
def test_split_properties(cores: int, threads: int, n: int, base: int) -> None:
    """Every CPU used, no CPU twice (while there are enough), siblings together when possible."""
    total = cores * threads
    cpus = [base + c for c in range(total)]
    smt = {}
    for core in range(cores):
        sib = tuple(base + core + t * cores for t in range(threads))
        for c in sib:
            smt[c] = sib
    topo = mktopo([mknode(0, cpus)], smt=smt)
    parts, mode = split_cpus(topo, cpus, n)
    assert len(parts) == n and all(parts)
    flat = [c for p in parts for c in p]
    if n <= total:
        assert sorted(flat) == sorted(cpus)  # a partition
    else:
        assert mode == "shared" and set(flat) == set(cpus)
    if n <= cores:
        assert mode == "cores"
        core_of = {c: smt[c] for c in cpus}
        for p in parts:
            assert all(set(core_of[c]) <= set(p) for c in p)
        sizes = [len(p) // threads for p in parts]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


# --- IRQ cores -----------------------------------------------------------------------


def test_reserve_irq_cpus_on_nic_node_only() -> None:
    topo = two_nodes_smt()
    topo.nics.append(nic("eth0", 0))
    plan = make_plan(topo, cfg(reserve_irq_cpus=1))
    assert plan.slots[0].cpus == (0, 1, 2, 3, 4, 5, 6, 16, 17, 18, 19, 20, 21, 22)
    assert plan.slots[1].cpus == (*range(8, 16), *range(24, 32))  # no NIC on node 1
    assert plan.irq_cpus == {0: (7, 23)}
    assert reserved_irq_cpus(topo, 0, 1) == (7, 23)
    assert reserved_irq_cpus(topo, 1, 1) == ()
    assert plan.to_json()["irq_cpus"] == {"0": [7, 23]}


def test_reserve_irq_cpus_excluded_from_auto_and_shared() -> None:
    topo = two_nodes_smt()
    topo.nics.append(nic("eth0", 0))
    plan = make_plan(topo, cfg(reserve_irq_cpus=2, workers_per_node="auto", nodes="0"))
    assert len(plan.slots) == 6
    assert all(not {6, 7, 22, 23} & set(s.cpus) for s in plan.slots)
    plan = make_plan(topo, cfg(reserve_irq_cpus=2, workers_per_node=2, cpu_split="shared", nodes="0"))
    assert plan.slots[0].cpus == plan.slots[1].cpus == (0, 1, 2, 3, 4, 5, 16, 17, 18, 19, 20, 21)


def test_reserve_irq_cpus_never_takes_the_whole_node() -> None:
    topo = two_nodes()
    topo.nics.append(nic("eth0", 1))
    plan = make_plan(topo, cfg(reserve_irq_cpus=10))
    assert plan.slots[1].cpus == (4,)
    assert plan.irq_cpus == {1: (5, 6, 7)}
    assert any("would take all 4 usable cores" in n for n in plan.notes)
    assert reserved_irq_cpus(topo, 1, 10) == (5, 6, 7)


def test_reserve_irq_cpus_single_core_node_reserves_nothing() -> None:
    topo = mktopo([mknode(0, [0, 1])], smt=smt_pairs(2), nics=[nic("eth0", 0)])
    plan = make_plan(topo, cfg(reserve_irq_cpus=1))
    assert plan.slots[0].cpus == (0, 1) and plan.irq_cpus == {}
    assert any("not applied" in n for n in plan.notes)


def test_reserve_irq_cpus_without_local_nic_notes_it() -> None:
    topo = two_nodes()
    topo.nics.append(nic("eth0", None))  # unknown node: not local to any
    plan = make_plan(topo, cfg(reserve_irq_cpus=1))
    assert cpus_of(plan) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert any("no planned node has a local NIC" in n for n in plan.notes)


def test_reserved_irq_cpus_helper_rejects_negative_and_unknown_node() -> None:
    with pytest.raises(ValueError):
        reserved_irq_cpus(two_nodes(), 0, -1)
    with pytest.raises(KeyError):
        reserved_irq_cpus(two_nodes(), 9, 1)
    assert reserved_irq_cpus(two_nodes(), 0, 0) == ()


# --- memory policy -----------------------------------------------------------------


def declared_pretend() -> Topology:
    """A one-node machine declared as two pretend nodes, both backed by real node 0."""
    return mktopo(
        [mknode(0, range(0, 2), memory_node=0), mknode(1, range(2, 4), memory_node=0)],
        allowed_mems=(0,),
        declared="/etc/numaserve/topology.toml",
    )


@pytest.mark.parametrize("policy", ["bind", "preferred", "interleave"])
def test_declared_pretend_nodes_bind_the_real_node(policy: str) -> None:
    plan = make_plan(declared_pretend(), cfg(mempolicy=policy))
    assert [s.node for s in plan.slots] == [0, 1]
    assert [s.memory_nodes for s in plan.slots] == [(0,), (0,)]
    assert all(s.mempolicy == policy for s in plan.slots)


def test_interleave_names_all_planned_memory_nodes() -> None:
    plan = make_plan(two_nodes(), cfg(mempolicy="interleave", workers_per_node=2))
    assert all(s.memory_nodes == (0, 1) for s in plan.slots)
    plan = make_plan(two_nodes(), cfg(mempolicy="interleave", nodes="1"))
    assert plan.slots[0].memory_nodes == (1,)


def test_local_names_no_node() -> None:
    plan = make_plan(two_nodes(), cfg(mempolicy="local"))
    assert all(s.memory_nodes == () and s.mempolicy == "local" for s in plan.slots)
    assert plan.mempolicy == "local"


def mems_narrowed() -> Topology:
    return mktopo([mknode(0, range(4)), mknode(1, range(4, 8))], allowed_mems=(0,))


def test_bind_node_not_in_allowed_mems_explicit_is_an_error() -> None:
    with pytest.raises(UsageError) as e:
        make_plan(mems_narrowed(), cfg(nodes="1"))
    msg = str(e.value)
    assert "node 1" in msg and "memory node 1 is not allowed" in msg and "allowed memory nodes: 0" in msg


def test_bind_node_not_in_allowed_mems_skipped_under_all() -> None:
    plan = make_plan(mems_narrowed(), cfg(mempolicy="preferred"))
    assert [s.node for s in plan.slots] == [0]
    assert plan.skipped[0].node == 1 and "allowed memory nodes: 0" in plan.skipped[0].reason


def test_mems_narrowed_local_and_interleave_still_plan() -> None:
    plan = make_plan(mems_narrowed(), cfg(mempolicy="local"))
    assert [s.node for s in plan.slots] == [0, 1]
    plan = make_plan(mems_narrowed(), cfg(mempolicy="interleave"))
    assert [s.memory_nodes for s in plan.slots] == [(0,), (0,)]


def test_memoryless_cpu_node_cannot_bind() -> None:
    topo = mktopo([mknode(0, range(4)), mknode(1, range(4, 8), has_memory=False)], allowed_mems=(0, 1))
    plan = make_plan(topo, cfg())
    assert [s.node for s in plan.slots] == [0]
    assert "has no memory" in plan.skipped[0].reason
    plan = make_plan(topo, cfg(mempolicy="local"))
    assert [s.node for s in plan.slots] == [0, 1]


# --- GPUs ---------------------------------------------------------------------------


def gpu_topo(n0: int, n1: int = 0) -> Topology:
    topo = two_nodes_smt()
    topo.gpus.extend(gpu(f"0000:{0x10 + i:02x}:00.0", 0) for i in range(n0))
    topo.gpus.extend(gpu(f"0000:{0x80 + i:02x}:00.0", 1) for i in range(n1))
    return topo


def test_gpus_split_round_robin() -> None:
    plan = make_plan(gpu_topo(4, 1), cfg(workers_per_node=2))
    assert plan.slots[0].gpus == ("0000:10:00.0", "0000:12:00.0")
    assert plan.slots[1].gpus == ("0000:11:00.0", "0000:13:00.0")
    # node 1 has one GPU for two workers: both see it
    assert plan.slots[2].gpus == plan.slots[3].gpus == ("0000:80:00.0",)
    assert any("node 1: 2 workers share its 1 GPU" in n for n in plan.notes)


def test_single_worker_sees_all_node_gpus() -> None:
    plan = make_plan(gpu_topo(2), cfg())
    assert plan.slots[0].gpus == ("0000:10:00.0", "0000:11:00.0")
    assert plan.slots[1].gpus == ()


def test_auto_is_one_worker_per_gpu() -> None:
    plan = make_plan(gpu_topo(2), cfg(workers_per_node="auto"))
    node0 = [s for s in plan.slots if s.node == 0]
    assert [s.gpus for s in node0] == [("0000:10:00.0",), ("0000:11:00.0",)]
    assert [s.cpus for s in node0] == [(0, 1, 2, 3, 16, 17, 18, 19), (4, 5, 6, 7, 20, 21, 22, 23)]
    assert len([s for s in plan.slots if s.node == 1]) == 8  # no GPU: one per core
    assert any("auto = 2 (one per GPU)" in n for n in plan.notes)


def test_slot_plan_is_hashable_and_frozen() -> None:
    s = make_plan(two_nodes(), cfg()).slots[0]
    assert isinstance(s, SlotPlan)
    with pytest.raises(AttributeError):
        s.cpus = ()  # type: ignore[misc]
