"""IRQ steering: plan (pure, on hand-built topologies), apply and restore on
copies of the fixture trees in tests/fixtures/irq, with kernel write errors
injected through the AffinityIO seam."""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from numaserve.errors import UsageError
from numaserve.net.irq import (
    FileIO,
    IrqbalanceConflict,
    IrqSettings,
    apply_plan,
    default_state_file,
    irqbalance_fixes,
    order_cores_first,
    plan_irqs,
    restore,
)
from numaserve.topology.model import Irq, Node, Topology

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "irq"
_spec = importlib.util.spec_from_file_location("numaserve_irq_fixture_topos", FIX / "topos.py")
topos = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(topos)


@pytest.fixture
def vm_root(tmp_path: Path) -> Path:
    dst = tmp_path / "root"
    shutil.copytree(FIX / "vm2n", dst, symlinks=True)
    return dst


@pytest.fixture
def smt_root(tmp_path: Path) -> Path:
    dst = tmp_path / "root"
    shutil.copytree(FIX / "smt2n", dst, symlinks=True)
    return dst


def aff(root: Path, irq: int) -> str:
    return (root / "proc" / "irq" / str(irq) / "smp_affinity_list").read_text().strip()


def snapshot(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted((root / "proc" / "irq").rglob("*"))
            if p.is_file()} | {
        p.relative_to(root).as_posix(): p.read_text()
        for p in sorted((root / "sys").rglob("*_cpus")) if p.is_file() and "queues" in p.as_posix()}


class FaultyIO(FileIO):
    """FileIO that raises a chosen errno when writing given IRQs (per CPU text, optionally)."""

    def __init__(self, errors: dict[int, int] | None = None, by_cpu: dict[tuple[int, str], int] | None = None,
                 files: dict[str, int] | None = None) -> None:
        self.errors = errors or {}
        self.by_cpu = by_cpu or {}
        self.files = files or {}
        self.writes: list[tuple[str, str]] = []

    def write(self, path: str, text: str) -> None:
        self.writes.append((path, text))
        parts = Path(path).parts
        if "irq" in parts and parts[-1] == "smp_affinity_list":
            irq = int(parts[-2])
            code = self.by_cpu.get((irq, text.strip()), self.errors.get(irq))
            if code is not None:
                raise OSError(code, "injected")
        for suffix, code in self.files.items():
            if path.endswith(suffix):
                raise OSError(code, "injected")
        super().write(path, text)


# --- plan -------------------------------------------------------------------------


def test_vm_plan_puts_queues_on_node1_and_leaves_config_alone() -> None:
    plan = plan_irqs(topos.vm2n())
    targets = {e.irq: e.target for e in plan.entries}
    assert set(targets) == set(range(32, 40))
    assert all(t in ((2,), (3,)) for t in targets.values())
    # input.q and output.q share a CPU; queues alternate 2,3,2,3
    assert [targets[i][0] for i in range(32, 40)] == [2, 2, 3, 3, 2, 2, 3, 3]
    assert [s.irq for s in plan.skipped] == [31]
    assert "admin" in plan.skipped[0].reason
    assert all(e.changed for e in plan.entries if e.queue in (0, 1))
    js = plan.to_json()
    assert js["entries"][0] == {"irq": 32, "name": "virtio3-input.0", "nic": "eth0", "queue": 0,
                                "current": "0", "target": "2", "changed": True}


def test_cores_before_smt_siblings() -> None:
    assert order_cores_first((2, 3, 6, 7), topos.SMT_SIBLINGS) == (2, 3, 6, 7)
    assert order_cores_first((0, 1, 4, 5), {0: (0, 1), 1: (0, 1), 4: (4, 5), 5: (4, 5)}) == (0, 4, 1, 5)
    assert order_cores_first((3, 1), {}) == (1, 3)
    plan = plan_irqs(topos.smt2n(), iface="eth0")
    # two cores (2, 3) first, then their siblings (6, 7), then round-robin
    assert [e.target[0] for e in plan.entries] == [2, 3, 6, 7, 2, 3]
    assert [e.queue for e in plan.entries] == [0, 1, 2, 3, 4, 5]


def test_siblings_used_only_after_cores() -> None:
    topo = topos.smt2n()
    # only one core-pair on node 1 is local to the NIC: 2 and its sibling 6
    topo.nics[0].local_cpus = (2, 6)
    plan = plan_irqs(topo, iface="eth0")
    assert [e.target[0] for e in plan.entries] == [2, 6, 2, 6, 2, 6]


def test_unknown_node_nic_skipped_with_fix() -> None:
    plan = plan_irqs(topos.smt2n())
    assert {e.nic for e in plan.entries} == {"eth0"}
    sk = [s for s in plan.skipped if s.nic == "eth1"]
    assert len(sk) == 1 and sk[0].irq is None
    assert "[nic.eth1] node = N" in sk[0].reason
    assert any("eth1" in w and "node" in w for w in plan.warnings)


def test_plan_intersects_online_allowed_local() -> None:
    topo = topos.smt2n()
    topo.online_cpus = (0, 1, 2, 4, 5, 6, 7)  # CPU 3 offline
    topo.allowed_cpus = (0, 1, 2, 4, 5, 6)  # 7 not allowed
    plan = plan_irqs(topo, iface="eth0")
    assert {e.target[0] for e in plan.entries} == {2, 6}
    assert all(set(e.candidates) == {2, 6} for e in plan.entries)


def test_no_usable_cpu_skips_nic() -> None:
    topo = topos.vm2n()
    topo.allowed_cpus = (0, 1)
    plan = plan_irqs(topo)
    assert plan.entries == []
    assert "no usable CPU on node 1" in plan.skipped[0].reason


def test_interfaces_filter_and_unknown_iface() -> None:
    plan = plan_irqs(topos.smt2n(), IrqSettings(interfaces=["eth1"]))
    assert plan.entries == [] and plan.skipped[0].nic == "eth1"
    with pytest.raises(UsageError, match="no physical NIC named eth9; found: eth0, eth1"):
        plan_irqs(topos.smt2n(), iface="eth9")


def test_unknown_kind_irq_left_alone() -> None:
    topo = topos.vm2n()
    topo.nics[0].irqs.append(Irq(40, "virtio3-weird", "unknown", None, (0,), (0,)))
    plan = plan_irqs(topo)
    assert 40 not in {e.irq for e in plan.entries}
    assert any(s.irq == 40 and "queue vector" in s.reason for s in plan.skipped)


def test_reserved_policy() -> None:
    topo = topos.smt2n()
    plan = plan_irqs(topo, IrqSettings(policy="reserved"), iface="eth0", reserved={1: (7,)})
    assert {e.target for e in plan.entries} == {(7,)}
    plan = plan_irqs(topo, IrqSettings(policy="reserved"), iface="eth0", reserved=None)
    assert plan.entries == [] and "reserve_irq_cpus" in plan.skipped[0].reason
    # reserved sets are ignored under the shared policy
    plan = plan_irqs(topo, IrqSettings(policy="shared"), iface="eth0", reserved={1: (7,)})
    assert {e.target[0] for e in plan.entries} == {2, 3, 6, 7}


def test_already_steered_is_unchanged() -> None:
    topo = topos.vm2n()
    irqs = [dataclasses.replace(i, affinity=(2,) if i.queue in (0, 2) else (3,)) if i.kind == "queue" else i
            for i in topo.nics[0].irqs]
    topo.nics[0].irqs = irqs
    plan = plan_irqs(topo)
    assert plan.changes == []


def test_rps_xps_entries() -> None:
    plan = plan_irqs(topos.vm2n(), IrqSettings(rps=True, xps=True))
    rps = [q for q in plan.queue_files if q.kind == "rps"]
    xps = [q for q in plan.queue_files if q.kind == "xps"]
    assert [q.path for q in rps] == [f"sys/class/net/eth0/queues/rx-{q}/rps_cpus" for q in range(4)]
    assert all(q.mask == "c" for q in rps)  # CPUs 2-3
    assert [q.mask for q in xps] == ["4", "8", "4", "8"]  # the CPU of each queue's IRQ
    assert plan_irqs(topos.vm2n()).queue_files == []


def test_settings_defaults_and_state_file() -> None:
    s = IrqSettings()
    assert (s.apply_at_start, s.policy, s.interfaces, s.irqbalance, s.rps, s.xps, s.state_file) == (
        False, "shared", [], "refuse", False, False, "")
    assert default_state_file(s) == "/var/lib/numaserve/irq-saved.json"
    assert default_state_file(s, "/run/numaserve") == "/run/numaserve/irq-saved.json"
    assert default_state_file(IrqSettings(state_file="/x.json"), "/run/n") == "/x.json"


def test_settings_struct_rejects_unknown_and_bad_values() -> None:
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"policy": "exclusive"}, IrqSettings)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"bogus": 1}, IrqSettings)


def test_no_nics() -> None:
    topo = Topology(root="/", nodes=[Node(0, (0,), (0,), None, None)], online_cpus=(0,), allowed_cpus=(0,),
                    allowed_mems=(0,))
    plan = plan_irqs(topo)
    assert plan.entries == [] and plan.warnings


# --- apply / restore ----------------------------------------------------------------


def test_apply_restore_roundtrip(vm_root: Path, tmp_path: Path) -> None:
    before = snapshot(vm_root)
    state = tmp_path / "state" / "irq-saved.json"
    plan = plan_irqs(topos.vm2n(vm_root))
    res = apply_plan(plan, str(vm_root), str(state))
    assert res.exit_code == 0, res.to_json()
    assert [aff(vm_root, i) for i in range(32, 40)] == ["2", "2", "3", "3", "2", "2", "3", "3"]
    assert aff(vm_root, 31) == "0-3"  # config vector untouched
    saved = json.loads(state.read_text())
    # queue 2 (36, 37) was already on CPU 2 and queue 3 (38, 39) on CPU 3: untouched, not saved
    assert saved["irqs"] == {"32": "0", "33": "0", "34": "1", "35": "1"}
    assert {r.irq: r.status for r in res.irqs} == {32: "ok", 33: "ok", 34: "ok", 35: "ok",
                                                   36: "unchanged", 37: "unchanged", 38: "unchanged",
                                                   39: "unchanged"}
    r = restore(str(vm_root), str(state))
    assert r.exit_code == 0 and r.state_removed
    assert [(x.irq, x.nic, x.name, x.status) for x in r.irqs][:2] == [
        (32, "eth0", "virtio3-input.0", "ok"), (33, "eth0", "virtio3-output.0", "ok")]
    assert not state.exists()
    assert snapshot(vm_root) == before


def test_apply_is_idempotent_and_keeps_original_state(vm_root: Path, tmp_path: Path) -> None:
    state = tmp_path / "irq-saved.json"
    apply_plan(plan_irqs(topos.vm2n(vm_root)), str(vm_root), str(state))
    first = state.read_text()
    io = FaultyIO()
    res = apply_plan(plan_irqs(topos.vm2n(vm_root)), str(vm_root), str(state), io=io)
    assert io.writes == []  # read back first: nothing to do
    assert {r.status for r in res.irqs} == {"unchanged"} and res.saved == 0
    assert state.read_text() == first
    # someone moves IRQ 32 by hand; a second apply fixes it but keeps the *original* saved value
    (vm_root / "proc/irq/32/smp_affinity_list").write_text("1\n")
    res = apply_plan(plan_irqs(topos.vm2n(vm_root)), str(vm_root), str(state))
    assert [r.status for r in res.irqs if r.irq == 32] == ["ok"]
    assert json.loads(state.read_text())["irqs"]["32"] == "0"
    restore(str(vm_root), str(state))
    assert aff(vm_root, 32) == "0"


def test_second_apply_adds_newly_touched_irqs_only(vm_root: Path, tmp_path: Path) -> None:
    state = tmp_path / "irq-saved.json"
    topo = topos.vm2n(vm_root)
    apply_plan(plan_irqs(topo), str(vm_root), str(state))
    # IRQ 36 (queue 2) drifts away from its target; the next apply saves *that* value once
    (vm_root / "proc/irq/36/smp_affinity_list").write_text("0\n")
    apply_plan(plan_irqs(topo), str(vm_root), str(state))
    saved = json.loads(state.read_text())["irqs"]
    assert saved == {"32": "0", "33": "0", "34": "1", "35": "1", "36": "0"}


def test_write_errors_reported_per_irq(smt_root: Path, tmp_path: Path) -> None:
    state = tmp_path / "irq-saved.json"
    plan = plan_irqs(topos.smt2n(smt_root), IrqSettings(irqbalance="warn"), iface="eth0")
    io = FaultyIO({50: errno.EIO, 51: errno.EPERM, 52: errno.ERANGE, 53: errno.EOVERFLOW,
                   54: errno.EINVAL, 55: errno.EBUSY})
    res = apply_plan(plan, str(smt_root), str(state), io=io)
    st = {r.irq: r for r in res.irqs}
    assert st[50].status == "managed" and "EIO" in st[50].error and "managed" in st[50].note
    assert st[51].status == "managed" and "EPERM" in st[51].error
    for i, name in ((52, "ERANGE"), (53, "EOVERFLOW"), (54, "EINVAL")):
        assert st[i].status == "bad-mask" and name in st[i].error and "bug" in st[i].note
    assert st[55].status == "failed" and "EBUSY" in st[55].error
    assert len(res.irqs) == 6  # never stopped at the first error
    assert res.exit_code == 1
    assert {r.irq for r in res.failed} == {52, 53, 54, 55}
    # the kernel rejected every write: nothing changed, so no original is kept
    assert json.loads(state.read_text())["irqs"] == {}
    assert all(aff(smt_root, i) == "0-7" for i in range(50, 56))
    assert restore(str(smt_root), str(state)).state_removed


def test_enospc_retries_another_cpu(smt_root: Path, tmp_path: Path) -> None:
    plan = plan_irqs(topos.smt2n(smt_root), IrqSettings(irqbalance="warn"), iface="eth0")
    io = FaultyIO(by_cpu={(50, "2"): errno.ENOSPC, (51, "3"): errno.ENOSPC, (51, "2"): errno.ENOSPC})
    res = apply_plan(plan, str(smt_root), str(tmp_path / "s.json"), io=io)
    st = {r.irq: r for r in res.irqs}
    assert st[50].status == "ok" and aff(smt_root, 50) == "3" and "ENOSPC" in st[50].note
    assert st[51].status == "ok" and aff(smt_root, 51) == "6"
    assert res.exit_code == 0


def test_enospc_everywhere_fails(smt_root: Path, tmp_path: Path) -> None:
    plan = plan_irqs(topos.smt2n(smt_root), IrqSettings(irqbalance="warn"), iface="eth0")
    io = FaultyIO(by_cpu={(50, c): errno.ENOSPC for c in "2367"})
    res = apply_plan(plan, str(smt_root), str(tmp_path / "s.json"), io=io)
    r50 = next(r for r in res.irqs if r.irq == 50)
    assert r50.status == "failed" and "ENOSPC" in r50.error and res.exit_code == 1
    assert aff(smt_root, 50) == "0-7"


def test_missing_irq_file(vm_root: Path, tmp_path: Path) -> None:
    shutil.rmtree(vm_root / "proc/irq/33")
    res = apply_plan(plan_irqs(topos.vm2n(vm_root)), str(vm_root), str(tmp_path / "s.json"))
    assert [r.status for r in res.irqs if r.irq == 33] == ["missing"]
    assert res.exit_code == 1
    assert aff(vm_root, 32) == "2"  # the rest still applied


def test_irqbalance_refuse_and_warn(smt_root: Path, tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    plan = plan_irqs(topos.smt2n(smt_root), iface="eth0")
    with pytest.raises(IrqbalanceConflict) as ei:
        apply_plan(plan, str(smt_root), str(state))
    msg = str(ei.value)
    assert "4242" in msg
    assert 'IRQBALANCE_ARGS="--banirq=50 --banirq=51 --banirq=52 --banirq=53 --banirq=54 --banirq=55"' in msg
    assert "IRQBALANCE_BANNED_CPULIST=2-3,6-7" in msg and "restart irqbalance" in msg
    assert not state.exists() and aff(smt_root, 50) == "0-7"
    # forced
    res = apply_plan(plan, str(smt_root), str(state), force=True)
    assert res.exit_code == 0 and any("10 s" in w for w in res.warnings)
    # warn mode
    restore(str(smt_root), str(state))
    plan = plan_irqs(topos.smt2n(smt_root), IrqSettings(irqbalance="warn"), iface="eth0")
    res = apply_plan(plan, str(smt_root), str(state))
    assert aff(smt_root, 50) == "2" and any("irqbalance" in w and "4242" in w for w in res.warnings)


def test_irqbalance_fixes_lines() -> None:
    assert irqbalance_fixes([33, 32], [3, 2]) == [
        'IRQBALANCE_ARGS="--banirq=32 --banirq=33"   (in /etc/default/irqbalance or /etc/sysconfig/irqbalance)',
        "IRQBALANCE_BANNED_CPULIST=2-3   (same file; keeps other IRQs off these CPUs)",
        "then: systemctl restart irqbalance",
    ]


def test_rps_xps_apply_restore_absent_tolerated(smt_root: Path, tmp_path: Path) -> None:
    before = snapshot(smt_root)
    state = tmp_path / "s.json"
    topo = topos.smt2n(smt_root)
    # eth0 in the fixture has xps_cpus for tx-0..5; drop one to check tolerance
    (smt_root / "sys/class/net/eth0/queues/tx-5/xps_cpus").unlink()
    before.pop("sys/devices/pci0000:40/0000:40:01.0/0000:41:00.0/net/eth0/queues/tx-5/xps_cpus", None)
    before = {k: v for k, v in before.items() if "tx-5/xps" not in k}
    plan = plan_irqs(topo, IrqSettings(rps=True, xps=True, irqbalance="warn"), iface="eth0")
    res = apply_plan(plan, str(smt_root), str(state))
    assert res.exit_code == 0, res.to_json()
    fs = {r.path: r.status for r in res.files}
    assert fs["sys/class/net/eth0/queues/tx-5/xps_cpus"] == "absent"
    assert fs["sys/class/net/eth0/queues/rx-0/rps_cpus"] == "ok"
    assert (smt_root / "sys/class/net/eth0/queues/rx-0/rps_cpus").read_text().strip() == "cc"
    assert (smt_root / "sys/class/net/eth0/queues/tx-1/xps_cpus").read_text().strip() == "8"
    assert restore(str(smt_root), str(state)).state_removed
    after = {k: v for k, v in snapshot(smt_root).items() if "tx-5/xps" not in k}
    assert after == before


def test_rps_write_failure_reported(smt_root: Path, tmp_path: Path) -> None:
    plan = plan_irqs(topos.smt2n(smt_root), IrqSettings(rps=True, irqbalance="warn"), iface="eth0")
    res = apply_plan(plan, str(smt_root), str(tmp_path / "s.json"), io=FaultyIO(files={"rx-1/rps_cpus": errno.EINVAL}))
    assert [r.status for r in res.files if "rx-1" in r.path] == ["failed"]
    assert res.exit_code == 1


def test_restore_keeps_state_on_failure_and_retries(vm_root: Path, tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    apply_plan(plan_irqs(topos.vm2n(vm_root)), str(vm_root), str(state))
    r = restore(str(vm_root), str(state), io=FaultyIO({33: errno.EBUSY}))
    assert r.exit_code == 1 and not r.state_removed and state.exists()
    assert aff(vm_root, 32) == "0" and aff(vm_root, 33) == "2"
    r = restore(str(vm_root), str(state))
    assert r.exit_code == 0 and r.state_removed
    assert [x.status for x in r.irqs] == ["unchanged", "ok", "unchanged", "unchanged"]
    assert aff(vm_root, 33) == "0"


def test_restore_gone_irq_and_nothing_saved(vm_root: Path, tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    r = restore(str(vm_root), str(state))
    assert r.nothing_saved and r.exit_code == 0
    apply_plan(plan_irqs(topos.vm2n(vm_root)), str(vm_root), str(state))
    shutil.rmtree(vm_root / "proc/irq/34")
    r = restore(str(vm_root), str(state))
    assert {x.irq: x.status for x in r.irqs}[34] == "gone"
    assert r.state_removed and r.exit_code == 0


def test_state_root_mismatch_is_usage_error(vm_root: Path, tmp_path: Path) -> None:
    state = tmp_path / "s.json"
    apply_plan(plan_irqs(topos.vm2n(vm_root)), str(vm_root), str(state))
    with pytest.raises(UsageError, match="saved for root"):
        restore(str(tmp_path), str(state))


def test_state_written_before_irqs(vm_root: Path, tmp_path: Path) -> None:
    """A crash between writes must still allow restore: the state exists before the first IRQ write."""
    state = tmp_path / "s.json"
    seen: list[bool] = []

    class Spy(FileIO):
        def write(self, path: str, text: str) -> None:
            seen.append(state.exists())
            super().write(path, text)

    apply_plan(plan_irqs(topos.vm2n(vm_root)), str(vm_root), str(state), io=Spy())
    assert seen and all(seen)


def test_fileio_uses_unbuffered_write(tmp_path: Path) -> None:
    p = tmp_path / "smp_affinity_list"
    p.write_text("0-15\n")
    FileIO().write(str(p), "3\n")
    assert p.read_text() == "3\n"  # truncated, not overlaid
    assert FileIO().read(str(tmp_path / "nope")) is None
    with pytest.raises(OSError) as ei:
        FileIO().write(str(tmp_path / "nope"), "1\n")
    assert ei.value.errno == errno.ENOENT


# --- properties -------------------------------------------------------------------------

from hypothesis import given, settings as hsettings, strategies as st  # noqa: E402


@st.composite
def smt_layout(draw):
    ncores = draw(st.integers(1, 12))
    threads = draw(st.integers(1, 4))
    ids = draw(st.permutations(range(ncores * threads)))
    cores = [tuple(sorted(ids[c * threads:(c + 1) * threads])) for c in range(ncores)]
    sib = {cpu: core for core in cores for cpu in core}
    subset = draw(st.sets(st.sampled_from(sorted(sib)), min_size=1))
    return sib, sorted(subset)


@hsettings(max_examples=200, deadline=None)
@given(smt_layout())
def test_order_cores_first_properties(layout) -> None:
    sib, cpus = layout
    out = order_cores_first(cpus, sib)
    assert sorted(out) == sorted(cpus)
    ncores = len({sib[c] for c in cpus})
    first = out[:ncores]
    assert len({sib[c] for c in first}) == ncores  # every core once before any sibling
