"""The limits manager and the leak watch against a fake SlotControl (no processes)."""

from __future__ import annotations

import asyncio
import signal

import pytest
from slotfakes import FakeSlots, held_operation

from numaserve.config import Config
from numaserve.loops.leak import LeakSettings
from numaserve.supervisor import leakwatch as LW
from numaserve.supervisor import slots as S
from numaserve.supervisor.leakwatch import LeakWatch
from numaserve.supervisor.limits import LimitsManager
from numaserve.supervisor.operations import Operations


def serving(n: int = 2, cfg: Config | None = None, nodes: int = 1) -> FakeSlots:
    f = FakeSlots(n, cfg=cfg, nodes=nodes, auto_ready=False)
    for slot in f.slots.values():
        f.start_worker(slot, 0.0)
        f.on_ready(slot, slot.worker, 0.5)
    f.auto_ready = True
    return f


# ---------------------------------------------------------------- limits


def test_operator_override_pushes_to_the_node_and_acks_count() -> None:
    async def main() -> None:
        f = serving(4, nodes=2)
        lim = LimitsManager(f, f)
        touched = lim.override([], 1, 16, None, push=False)
        assert sorted(touched) == [1, 3]                   # node 1's slots only
        assert f.sent == []                                # push=False: nothing sent yet
        acks = await lim.push_acked(touched)
        pids = {f.slots[s].worker.pid for s in (1, 3)}
        assert {pid for pid, name, _ in f.sent if name == "set_limits"} == pids
        assert set(acks) == {"1", "3"} and all(a["ok"] for a in acks.values())
        epoch = lim.epochs[1]
        assert lim.status(f.slots[1])["applied_epoch"] == epoch
        assert lim.status(f.slots[0])["applied_epoch"] is None

    asyncio.run(main())


def test_a_new_worker_starts_at_its_slots_current_epoch() -> None:
    f = serving(1)
    lim = LimitsManager(f, f)
    lim.override([0], None, 8, None, push=False)
    f.sent.clear()
    w = f.slots[0].worker
    lim.on_hello(f.slots[0], w)
    [(pid, name, args)] = f.sent
    assert (pid, name) == (w.pid, "set_limits") and args["epoch"] == lim.epochs[0] and args["concurrency"] == 8


def test_limits_do_nothing_while_stopping() -> None:
    f = serving(1)
    lim = LimitsManager(f, f)
    f.stopping = True
    lim.tick(1e9)
    assert f.sent == [] and lim.last_decision == {}


# ------------------------------------------------------------- leak watch


@pytest.fixture
def rss(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """Per-pid RSS the leak watch reads (instead of /proc)."""
    table: dict[int, int] = {}
    monkeypatch.setattr(LW, "read_statm_rss", lambda pid: table.get(pid))
    monkeypatch.setattr(LW, "read_smaps_rollup", lambda pid: {"Uss": table.get(pid, 0), "Pss": table.get(pid, 0)})
    return table


def test_hard_cap_kills_the_worker_through_slot_control(rss: dict[int, int]) -> None:
    f = serving(1)
    lw = LeakWatch(f, f, Operations(f, f), tuning=LeakSettings(uss_interval_s=0.0))
    lw.budget = 100 * 1024 * 1024
    w = f.slots[0].worker
    rss[w.pid] = 99 * 1024 * 1024                        # ≥ 95 % of the budget
    for t in range(1, 40):
        lw.tick(float(t))
        if ("kill", w.generation) in f.calls:
            break
    assert ("kill", 1) in f.calls and (w.pid, signal.SIGKILL) in f.signals
    assert w.kill_reason is not None and w.kill_reason.startswith("hard memory cap")
    assert lw.status(f.slots[0])["verdict"] == "hard_cap"


def test_soft_cap_recycles_through_a_tracked_replace(rss: dict[int, int]) -> None:
    async def main() -> None:
        f = serving(1)
        ops = Operations(f, f)
        lw = LeakWatch(f, f, ops, tuning=LeakSettings(uss_interval_s=0.0))
        lw.budget = 100 * 1024 * 1024
        w = f.slots[0].worker
        rss[w.pid] = 90 * 1024 * 1024                    # past the soft cap, under the hard one
        for t in range(1, 40):
            lw.tick(float(t))
            if ops.current is not None:
                break
        op = ops.current
        assert op is not None and op.kind == "leak" and op.args["reason"].startswith("soft memory cap")
        await asyncio.wait_for(op.done.wait(), 5)
        assert op.state == "succeeded", op.result
        assert f.slots[0].worker.generation == 2 and f.slots[0].state == S.READY
        assert ("drain", 0, 1) in f.calls                 # the old one drained only after the new one
        assert f.calls.index(("mark_ready", 0)) < f.calls.index(("drain", 0, 1))
        # the next verdict on the new generation is not deferred by a running operation
        assert ops.current.state == "succeeded"

    asyncio.run(main())


def test_a_recycle_is_deferred_while_another_operation_runs(rss: dict[int, int]) -> None:
    async def main() -> None:
        f = serving(1)
        ops = Operations(f, f)
        other, gate = held_operation(ops, [0])
        lw = LeakWatch(f, f, ops, tuning=LeakSettings(uss_interval_s=0.0))
        lw.budget = 100 * 1024 * 1024
        w = f.slots[0].worker
        rss[w.pid] = 90 * 1024 * 1024
        for t in range(1, 40):
            lw.tick(float(t))
        assert ops.current is other and f.slots[0].worker is w    # no second operation, no recycle
        gate.set()
        await other.done.wait()

    asyncio.run(main())


def test_uss_is_read_at_the_interval_while_rss_moves_and_rarely_while_flat(
        rss: dict[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[float] = []
    monkeypatch.setattr(LW, "read_smaps_rollup", lambda pid: reads.append(now[0]) or {"Uss": 1, "Pss": 1})
    f = serving(1)
    lw = LeakWatch(f, f, Operations(f, f), tuning=LeakSettings(uss_interval_s=10.0))
    w = f.slots[0].worker
    rss[w.pid] = 50 << 20
    now = [0.0]
    for t in range(10, 131):                       # flat RSS: the first read, then every 60 s
        now[0] = float(t)
        lw.tick(now[0])
    assert reads == [10.0, 70.0, 130.0]
    reads.clear()
    for t in range(131, 171):                      # RSS growing: back to every 10 s
        now[0] = float(t)
        rss[w.pid] += 256 << 10
        lw.tick(now[0])
    assert reads == [140.0, 150.0, 160.0, 170.0]


def test_unchanged_limits_are_resent_only_to_renew_the_lease() -> None:
    from numaserve.supervisor.limits import renew_due

    f = serving(2)
    lim = LimitsManager(f, f)
    lim.override([0, 1], None, 8, None, push=False)
    f.sent.clear()
    lim.push(0)
    lim.push(0)                        # the loop decided the same again: nothing new to say
    assert [(pid, name) for pid, name, _ in f.sent] == [(f.slots[0].worker.pid, "set_limits")]
    lim.override([0], None, 9, None, push=False)
    lim.push(0)                        # changed: sent at once
    assert len(f.sent) == 2 and f.sent[-1][2]["concurrency"] == 9
    args = f.sent[-1][2]
    lease = args["lease_s"]
    assert not renew_due(args, dict(args), 100.0, 100.0 + lease / 2 - 0.1)
    assert renew_due(args, dict(args), 100.0, 100.0 + lease / 2)        # half the lease gone: renew
    assert renew_due(args, {**args, "epoch": args["epoch"] + 1}, 100.0, 100.0)
    assert renew_due({}, {"epoch": 1}, 0.0, 0.0)                         # no lease to go by: always


def test_a_new_generation_gets_the_limits_even_if_unchanged() -> None:
    f = serving(1)
    lim = LimitsManager(f, f)
    lim.override([0], None, 8, None, push=False)
    lim.push(0)
    f.sent.clear()
    old = f.slots[0].worker
    old.popen.exit(0)
    f.slots[0].worker = f.spawn_generation(f.slots[0], 1.0)
    assert f.slots[0].worker.generation != old.generation
    lim.push(0)
    assert [pid for pid, _, _ in f.sent] == [f.slots[0].worker.pid]
