"""Operations against a fake SlotControl: the exact order of steps, and what fails how."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from slotfakes import FakeSlots, held_operation

from numaserve.config import Config
from numaserve.errors import NumaserveError
from numaserve.supervisor import slots as S
from numaserve.supervisor.operations import Operation, Operations


def serving(n: int = 2, **kw: Any) -> FakeSlots:
    f = FakeSlots(n, auto_ready=False, **kw)
    for slot in f.slots.values():
        f.start_worker(slot, 0.0)
        f.on_ready(slot, slot.worker, 0.5)
    f.auto_ready = True
    f.calls.clear()
    return f


async def run(ops: Operations, kind: str, slots: list[int], body: Any) -> Operation:
    op = ops.start(kind, {}, slots, body)
    await asyncio.wait_for(op.done.wait(), 5)
    return op


def test_replace_is_make_before_break() -> None:
    async def main() -> None:
        f = serving(1)
        ops = Operations(f, f)
        slot = f.slots[0]
        old = slot.worker
        op = await run(ops, "restart", [0], lambda op: ops.roll(op, [slot], 5.0, 1))
        assert op.state == "succeeded", op.result
        # the new generation is spawned and Ready before the old one is told to drain
        assert f.calls == [("spawn", 0, 2), ("mark_ready", 0), ("drain", 0, 1)]
        assert [s["message"] for s in op.steps] == [
            "started", "slot 0: generation 2 starting beside 1", "slot 0: generation 2 ready; draining 1",
            "slot 0: generation 1 exited (exit 0)", "succeeded"]
        assert slot.worker is not old and slot.worker.generation == 2 and slot.state == S.READY
        assert slot.retiring == [] and slot.incoming is None and slot.operation is None
        assert slot.totals_before.restarts_by_reason == {"restart": 1}

    asyncio.run(main())


def test_replace_keeps_the_old_worker_when_the_new_one_dies() -> None:
    async def main() -> None:
        f = serving(1)
        f.auto_ready = False
        ops = Operations(f, f)
        slot = f.slots[0]
        old = slot.worker

        def die_soon() -> None:
            new = slot.incoming
            assert new is not None
            new.goodbye = "app failed"
            f.exit(new, 3)

        asyncio.get_running_loop().call_later(0.05, die_soon)
        op = await run(ops, "restart", [0], lambda op: ops.roll(op, [slot], 5.0, 1))
        assert op.state == "failed"
        assert "new worker (generation 2) failed" in op.result and "old worker kept serving" in op.result
        assert "(replaced 0 of 1 slots before it)" in op.result
        assert slot.worker is old and slot.state == S.READY and slot.incoming is None
        assert ("drain", 0, 1) not in f.calls

    asyncio.run(main())


def test_roll_stops_at_the_first_failed_batch() -> None:
    async def main() -> None:
        f = serving(3)
        ops = Operations(f, f)
        spawned = []
        orig = f._spawn

        def spawn(cfg: Any, plan: Any, generation: int, now: float) -> Any:
            if plan.slot == 1:
                raise OSError("no memory")
            spawned.append(plan.slot)
            return orig(cfg, plan, generation, now)

        f.spawn_worker = spawn
        op = await run(ops, "restart", [0, 1, 2], lambda op: ops.roll(op, list(f.slots.values()), 5.0, 1))
        assert op.state == "failed"
        assert op.result.startswith("slot 1: could not spawn the new worker: no memory; old worker kept")
        assert "(replaced 1 of 3 slots before it)" in op.result
        assert spawned == [0]                    # slot 2 never touched
        assert f.slots[2].worker.generation == 1

    asyncio.run(main())


def test_drain_steers_first_waits_for_the_queue_then_drains() -> None:
    async def main() -> None:
        f = serving(2)
        ops = Operations(f, f)
        slot = f.slots[1]
        op = await run(ops, "drain", [1], lambda op: ops.drain_slots(op, [slot], 2.0))
        assert op.state == "succeeded", op.result
        assert f.calls[0] == ("steer", (0,))     # slot 1 out of steering before any stop
        assert f.calls[1] == ("drain", 1, 1)
        assert slot.state == S.DRAINED and slot.drained and slot.worker is None
        assert [s["message"] for s in op.steps][1:3] == ["steered new connections away", "told workers to drain"]
        # undrain brings it back and steers again
        op = await run(ops, "undrain", [1], lambda op: ops.undrain_slots(op, [slot]))
        assert op.state == "succeeded" and slot.state == S.READY and not slot.drained
        assert f.calls[-1] == ("steer", (0, 1))

    asyncio.run(main())


def test_drain_times_out_naming_the_work_left() -> None:
    async def main() -> None:
        f = serving(1, exit_on_stop=False)
        ops = Operations(f, f)
        slot = f.slots[0]
        op = await run(ops, "drain", [0], lambda op: ops.drain_slots(op, [slot], 0.3))
        assert op.state == "failed"
        assert op.result.startswith("timeout after 0.3s with work left: slot 0 pid ")
        assert "warning: no slot left serving: new connections queue until undrain" in [s["message"] for s in op.steps]

    asyncio.run(main())


def test_one_mutating_operation_at_a_time_and_none_while_stopping() -> None:
    async def main() -> None:
        f = serving(1)
        ops = Operations(f, f)
        first, gate = held_operation(ops, [0])
        with pytest.raises(NumaserveError, match=f"operation {first.id} \\(restart\\) is still running"):
            held_operation(ops, [0], "drain")
        gate.set()
        await first.done.wait()
        assert first.state == "succeeded" and first.result == "held" and f.wake.is_set()
        f.stopping = True
        with pytest.raises(NumaserveError, match="stopping"):
            held_operation(ops, [0], "drain")

    asyncio.run(main())


def test_a_bug_in_a_body_fails_the_operation_not_the_caller() -> None:
    async def main() -> None:
        f = serving(1)
        ops = Operations(f, f)
        seen: list[str] = []

        async def broken(op: Operation) -> str:
            raise KeyError("x")

        op = ops.start("restart", {}, [0], broken)
        op.on_finish.append(lambda o: seen.append(o.state))
        await op.done.wait()
        assert op.state == "failed" and op.result == "internal error: KeyError: 'x'" and seen == ["failed"]

    asyncio.run(main())


def test_roll_starts_the_next_slot_while_the_previous_old_worker_drains() -> None:
    async def main() -> None:
        f = serving(3, exit_on_stop=False)
        ops = Operations(f, f)
        olds = {s: sl.worker for s, sl in f.slots.items()}
        op = ops.start("reload", {}, [0, 1, 2], lambda op: ops.roll(op, list(f.slots.values()), 5.0, 1))
        for _ in range(50):
            await asyncio.sleep(0)
        # every slot switched to its Ready replacement, each old one told to drain only after that,
        # while none of the old workers has exited yet
        assert f.calls == [("spawn", 0, 2), ("mark_ready", 0), ("drain", 0, 1),
                           ("spawn", 1, 2), ("mark_ready", 1), ("drain", 1, 1),
                           ("spawn", 2, 2), ("mark_ready", 2), ("drain", 2, 1)]
        assert op.state == "running"  # the operation ends when the old workers are gone
        assert all(sl.state == S.READY and sl.worker.generation == 2 for sl in f.slots.values())
        for s in (2, 0, 1):
            f.exit(olds[s], 0)
        await asyncio.wait_for(op.done.wait(), 5)
        assert op.state == "succeeded", op.result
        exited = [m["message"] for m in op.steps if m["message"].endswith("exited (exit 0)")]
        assert sorted(exited) == [f"slot {s}: generation 1 exited (exit 0)" for s in range(3)]

    asyncio.run(main())


def test_roll_fails_when_an_old_worker_never_exits() -> None:
    async def main() -> None:
        cfg = Config()
        cfg.supervisor.stop_timeout = 0.05
        f = serving(2, exit_on_stop=False, cfg=cfg)
        ops = Operations(f, f)
        olds = {s: sl.worker for s, sl in f.slots.items()}
        # the wait for an old worker is drain timeout + stop_timeout + 5 s: make it 0.15 s
        op = ops.start("reload", {}, [0, 1], lambda op: ops.roll(op, list(f.slots.values()), -4.9, 1))
        await asyncio.sleep(0.01)
        f.exit(olds[1], 0)
        await asyncio.wait_for(op.done.wait(), 5)
        assert op.state == "failed" and op.result == f"slot 0: old worker pid {olds[0].pid} did not exit"
        assert all(sl.worker.generation == 2 for sl in f.slots.values())  # both replacements serve

    asyncio.run(main())


def test_restart_is_one_call_that_rolls_reload_parallel_slots_at_a_time() -> None:
    async def main() -> None:
        cfg = Config()
        cfg.ops.reload_parallel = 2
        f = serving(3, cfg=cfg)
        ops = Operations(f, f)
        args = {"all": True}
        op = ops.restart(args, list(f.slots.values()), 5.0)
        assert ops.get(op.id) is op and ops.current is op
        assert (op.kind, op.args, op.slots) == ("restart", args, [0, 1, 2])
        await asyncio.wait_for(op.done.wait(), 5)
        assert op.state == "succeeded" and op.result == "replaced 3 slot(s)", op.result
        # slots 0 and 1 are one batch (both spawned before either is Ready), slot 2 the next
        assert f.calls[:2] == [("spawn", 0, 2), ("spawn", 1, 2)]
        assert f.calls.index(("spawn", 2, 2)) > max(f.calls.index(("drain", 0, 1)), f.calls.index(("drain", 1, 1)))
        assert all(sl.worker.generation == 2 and sl.state == S.READY for sl in f.slots.values())
        assert all(sl.totals_before.restarts_by_reason == {"restart": 1} for sl in f.slots.values())

    asyncio.run(main())


def test_drain_and_undrain_are_one_call_each_with_their_slots_and_args() -> None:
    async def main() -> None:
        f = serving(2)
        ops = Operations(f, f)
        slot = f.slots[1]
        op = ops.drain({"slot": 1}, [slot], 2.0)
        assert ops.current is op and (op.kind, op.args, op.slots) == ("drain", {"slot": 1}, [1])
        await asyncio.wait_for(op.done.wait(), 5)
        assert op.state == "succeeded" and slot.state == S.DRAINED, op.result
        op = ops.undrain({"slot": 1}, [slot])
        assert (op.kind, op.slots) == ("undrain", [1])
        await asyncio.wait_for(op.done.wait(), 5)
        assert op.state == "succeeded" and slot.state == S.READY and f.calls[-1] == ("steer", (0, 1))

    asyncio.run(main())
