"""The locality watch against a fake SlotControl: injected samples, a recorded migrator (no processes)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Callable

import msgspec
from slotfakes import FakeSlots, held_operation

from numaserve.bind.locality import LocalitySample
from numaserve.config import Config
from numaserve.supervisor import slots as S
from numaserve.supervisor.localitywatch import BUDGET_ENV, CPU_BUDGET, LocalityWatch, in_thread, sample_all
from numaserve.supervisor.operations import Operations


def cfg(**placement: Any) -> Config:
    c = Config()
    return msgspec.structs.replace(c, placement=msgspec.structs.replace(c.placement, **placement))


def serving(n: int, c: Config) -> FakeSlots:
    f = FakeSlots(n, cfg=c, nodes=2, auto_ready=False)
    for slot in f.slots.values():
        f.start_worker(slot, 0.0)
        f.on_ready(slot, slot.worker, 0.5)
    f.auto_ready = True
    return f


class World:
    """Per pid: the local share the sampler reports (bytes on its node vs node 1 - its node)."""

    def __init__(self) -> None:
        self.ratio: dict[int, float] = {}
        self.cost = 0.0001
        self.sampled: list[int] = []
        self.migrated: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        self.fail: OSError | None = None

    def sample(self, pid: int, nodes: tuple[int, ...], cpus: tuple[int, ...]) -> LocalitySample:
        self.sampled.append(pid)
        r = self.ratio.get(pid, 1.0)
        other = 1 - nodes[0]
        return LocalitySample(pid, nodes, {nodes[0]: int(1000 * r), other: 1000 - int(1000 * r)},
                              threads=4, threads_off_node=1 if r < 1 else 0, cost_s=self.cost)

    def migrate(self, pid: int, src: tuple[int, ...], dst: tuple[int, ...]) -> int:
        if self.fail:
            raise self.fail
        self.migrated.append((pid, src, dst))
        self.ratio[pid] = 1.0
        return 0


def inline(fn: Callable[[], int]) -> Future[int]:
    """The offload as a call here and now (the migrate's result is there at once)."""
    fut: Future[int] = Future()
    try:
        fut.set_result(fn())
    except Exception as e:
        fut.set_exception(e)
    return fut


class Held:
    """The offload as a thread that has not finished: ``finish()`` lets the held calls run.
    ``only``: hold just the calls of this function (the others run inline)."""

    def __init__(self, only: Callable[..., Any] | None = None) -> None:
        self.only = only
        self.calls: list[tuple[Callable[[], Any], Future[Any]]] = []

    def __call__(self, fn: Callable[[], Any]) -> Future[Any]:
        if self.only is not None and getattr(fn, "func", None) != self.only:
            return inline(fn)
        fut: Future[Any] = Future()
        self.calls.append((fn, fut))
        return fut

    def finish(self) -> None:
        for fn, fut in self.calls:
            fut.set_result(fn())
        self.calls.clear()


def watch(f: FakeSlots, world: World, ops: Operations | None = None,
          offload: Callable[[Callable[[], int]], Future[int]] = inline) -> LocalityWatch:
    return LocalityWatch(f, ops or Operations(f, f), lambda node: (node * 2, node * 2 + 1),
                         sampler=world.sample, migrator=world.migrate, clock=lambda: 100.0, env={},
                         offload=offload)


def test_samples_show_in_status_and_off_never_repairs() -> None:
    f = serving(2, cfg(locality_interval=1.0))
    world = World()
    lw = watch(f, world)
    w0 = f.slots[0].worker
    world.ratio[w0.pid] = 0.25
    for t in range(1, 10):
        lw.tick(float(t))
    st = lw.status(f.slots[0])
    assert st["local_ratio"] == 0.25 and st["threads_off_node"] == 1 and st["threads"] == 4
    assert st["anon_bytes"] == 1000 and st["remote_anon_bytes"] == 750 and st["nodes"] == [0]
    assert st["low_samples"] == 9 and st["repair"] == "off" and st["repairs"] == {}
    assert world.migrated == []
    assert lw.status(f.slots[1])["local_ratio"] == 1.0


def test_migrate_after_the_hold_moves_pages_back_and_counts_it() -> None:
    f = serving(2, cfg(locality_interval=1.0, repair="migrate", repair_threshold=0.9, repair_hold=3))
    world = World()
    lw = watch(f, world)
    w1 = f.slots[1].worker            # slot 1 is on node 1 (FakeSlots spreads slots over the nodes)
    world.ratio[w1.pid] = 0.5
    lw.tick(1.0)
    lw.tick(2.0)
    assert world.migrated == []
    lw.tick(3.0)
    assert world.migrated == [(w1.pid, (0,), (1,))]
    st = lw.status(f.slots[1])
    assert st["repairs"] == {"migrate": 1} and st["last_repairs"][0]["result"] == "ok"
    assert st["last_repairs"][0]["local_ratio"] == 0.5 and st["low_samples"] == 0
    lw.tick(3.5)                      # the result is measured on the next tick, not an interval later
    assert lw.status(f.slots[1])["local_ratio"] == 1.0
    for t in range(4, 20):
        lw.tick(float(t))
    assert len(world.migrated) == 1


def test_a_migrate_runs_off_the_loop_and_its_slot_waits_for_it() -> None:
    """The tick that starts a migrate returns before it ends (the kernel may copy GiBs); the slot
    is not sampled meanwhile, and the result is counted on the first tick after it ended."""
    f = serving(2, cfg(locality_interval=1.0, repair="migrate", repair_threshold=0.9, repair_hold=1))
    world = World()
    held = Held(only=world.migrate)
    lw = watch(f, world, offload=held)
    w1 = f.slots[1].worker
    world.ratio[w1.pid] = 0.5
    lw.tick(1.0)
    assert len(held.calls) == 1 and world.migrated == [] and lw.status(f.slots[1])["repairs"] == {}
    sampled = list(world.sampled)
    lw.tick(2.0)
    lw.tick(3.0)
    assert world.sampled.count(w1.pid) == sampled.count(w1.pid)       # not sampled while it runs
    assert world.sampled.count(f.slots[0].worker.pid) > sampled.count(f.slots[0].worker.pid)
    held.finish()
    assert world.migrated == [(w1.pid, (0,), (1,))] and lw.status(f.slots[1])["repairs"] == {}
    lw.tick(4.0)                      # counted, and sampled again at once
    st = lw.status(f.slots[1])
    assert st["repairs"] == {"migrate": 1} and st["last_repairs"][0]["result"] == "ok"
    lw.tick(4.5)
    assert lw.status(f.slots[1])["local_ratio"] == 1.0 and len(held.calls) == 0


def test_samples_are_judged_after_their_batch_ends_and_a_replaced_workers_sample_is_dropped() -> None:
    """Reading numa_maps walks the worker's page tables (74 ms for 6 GiB here): the tick that
    starts the samples returns before they end, they are judged on the first tick after, and a
    sample of a worker that was replaced meanwhile is dropped (its successor is sampled)."""
    f = serving(2, cfg(locality_interval=1.0))
    world = World()
    held = Held(only=sample_all)
    lw = watch(f, world, offload=held)
    w0, slot1 = f.slots[0].worker, f.slots[1]
    world.ratio[w0.pid] = 0.25
    old = slot1.worker
    lw.tick(1.0)
    assert len(held.calls) == 1 and world.sampled == []
    f.start_worker(slot1, 1.2)        # slot 1 gets a new worker while the old one is sampled
    assert slot1.worker is not old
    held.finish()
    assert world.sampled == [w0.pid, old.pid] and lw.samples == 0
    lw.tick(1.5)                      # judged: slot 0's sample counts, the old worker's is dropped
    assert lw.status(f.slots[0])["local_ratio"] == 0.25 and lw.samples == 1
    assert lw.status(slot1)["local_ratio"] is None
    held.finish()                     # the new worker's sample, started by that tick
    lw.tick(1.6)
    assert world.sampled[-1] == slot1.worker.pid and lw.status(slot1)["local_ratio"] == 1.0 and lw.samples == 2


def test_a_sample_judged_a_tick_late_keeps_the_interval_from_when_it_was_taken() -> None:
    """locality_interval = 1 s, ticks 1 s apart, each batch judged on the next tick: every worker
    is still sampled every second (judging from the tick that judged it gave every other second)."""
    f = serving(1, cfg(locality_interval=1.0))
    world = World()
    held = Held(only=sample_all)
    lw = watch(f, world, offload=held)
    for t in range(1, 11):
        lw.tick(float(t))
        held.finish()
    assert len(world.sampled) == 10 and lw.samples == 9


def test_a_batch_that_does_not_return_is_logged_once_and_sampling_resumes_after_it() -> None:
    from structlog.testing import capture_logs

    from numaserve.supervisor.localitywatch import STUCK_AFTER_S

    f = serving(1, cfg(locality_interval=1.0))
    world = World()
    held = Held(only=sample_all)
    lw = watch(f, world, offload=held)
    with capture_logs() as logs:
        for t in range(0, int(STUCK_AFTER_S) + 30, 10):
            lw.tick(float(t))
    stuck = [e for e in logs if e["event"] == "locality_sample_stuck"]
    assert len(stuck) == 1 and stuck[0]["slots"] == [0] and stuck[0]["seconds"] >= STUCK_AFTER_S
    assert len(held.calls) == 1 and lw.samples == 0
    held.finish()
    lw.tick(STUCK_AFTER_S + 40)
    assert lw.samples == 1 and len(held.calls) == 1      # judged, and the next batch started


def test_a_worker_that_cannot_be_read_does_not_stop_the_others_samples() -> None:
    def gone() -> LocalitySample:
        raise ProcessLookupError(3, "No such process")

    def fine() -> LocalitySample:
        return LocalitySample(7, (0,), {0: 10}, threads=1, threads_off_node=0, cost_s=0.0)

    got = sample_all([gone, fine])
    assert isinstance(got[0], ProcessLookupError) and isinstance(got[1], LocalitySample)


def test_in_thread_runs_the_call_in_another_thread() -> None:
    here = threading.get_ident()
    assert in_thread(threading.get_ident).result(5) != here
    fut = in_thread(lambda: 1 // 0)
    assert isinstance(fut.exception(5), ZeroDivisionError)


def test_a_failed_migrate_is_counted_with_its_error() -> None:
    f = serving(1, cfg(locality_interval=1.0, repair="migrate", repair_hold=1))
    world = World()
    world.fail = PermissionError(1, "migrate_pages(pid 1, nodes 1 -> 0): Operation not permitted")
    lw = watch(f, world)
    world.ratio[f.slots[0].worker.pid] = 0.1
    lw.tick(1.0)
    st = lw.status(f.slots[0])
    assert st["repairs"] == {"migrate": 1}
    assert st["last_repairs"][0]["result"] == "failed" and "not permitted" in st["last_repairs"][0]["error"]


def test_recycle_replaces_the_worker_make_before_break() -> None:
    async def main() -> None:
        f = serving(1, cfg(locality_interval=1.0, repair="recycle", repair_hold=2))
        ops = Operations(f, f)
        world = World()
        lw = watch(f, world, ops)
        world.ratio[f.slots[0].worker.pid] = 0.3
        lw.tick(1.0)
        assert ops.current is None
        lw.tick(2.0)
        op = ops.current
        assert op is not None and op.kind == "locality" and op.args["reason"].startswith("locality: 30.0%")
        await asyncio.wait_for(op.done.wait(), 5)
        assert op.state == "succeeded", op.result
        assert f.slots[0].worker.generation == 2 and f.slots[0].state == S.READY
        assert f.calls.index(("mark_ready", 0)) < f.calls.index(("drain", 0, 1))
        assert lw.status(f.slots[0])["repairs"] == {"recycle": 1}
        lw.tick(3.0)                   # the new generation: sampled afresh, all local
        assert lw.status(f.slots[0])["local_ratio"] == 1.0 and lw.status(f.slots[0])["low_samples"] == 0

    asyncio.run(main())


def test_recycle_waits_for_a_running_operation_then_happens() -> None:
    async def main() -> None:
        f = serving(1, cfg(locality_interval=1.0, repair="recycle", repair_hold=1))
        ops = Operations(f, f)
        other, gate = held_operation(ops, [0])
        world = World()
        lw = watch(f, world, ops)
        world.ratio[f.slots[0].worker.pid] = 0.3
        for t in range(1, 5):
            lw.tick(float(t))
        assert ops.current is other and lw.status(f.slots[0])["repairs"] == {}
        gate.set()
        await other.done.wait()
        lw.tick(5.0)
        assert ops.current is not other and ops.current.kind == "locality"
        await asyncio.wait_for(ops.current.done.wait(), 5)

    asyncio.run(main())


def test_expensive_samples_are_spaced_to_the_cpu_budget_and_zero_interval_is_off() -> None:
    f = serving(2, cfg(locality_interval=1.0))
    world = World()
    world.cost = 5.25 * CPU_BUDGET     # 2 workers at this cost a sample: one round per 10.5 s within the budget
    lw = watch(f, world)
    for t in range(0, 31):
        lw.tick(float(t))
    # rounds at 0, then at the first tick past each 10.5 s: 0, 11, 22 (slot 1 with slot 0, or a tick later)
    assert len(world.sampled) == 6, world.sampled
    assert lw.status(f.slots[0])["interval_s"] == 10.5
    summary = lw.summary()
    assert summary["samples"] == 6 and summary["cpu_s"] == round(6 * world.cost, 6)
    assert summary["cpu_budget"] == CPU_BUDGET
    assert summary["cpu_s"] / 30.0 <= CPU_BUDGET * 1.5        # the budget holds over the run (first round at 0)
    off = serving(1, cfg(locality_interval=0.0))
    world2 = World()
    lw2 = watch(off, world2)
    lw2.tick(1.0)
    assert world2.sampled == [] and lw2.status(off.slots[0])["local_ratio"] is None


def test_a_low_worker_is_confirmed_at_the_base_interval_once_per_worker() -> None:
    f = serving(1, cfg(locality_interval=1.0, repair="migrate", repair_hold=3))
    world = World()
    world.cost = 50 * CPU_BUDGET        # one worker: a sample every 50 s within the budget
    lw = watch(f, world)
    w = f.slots[0].worker
    lw.tick(0.0)
    world.ratio[w.pid] = 0.5            # drifts
    for t in range(1, 50):
        lw.tick(float(t))
    assert len(world.sampled) == 1      # not due yet: the stretched interval
    lw.tick(50.0)                       # low 1; low 2 and the repair follow at the base interval
    lw.tick(51.0)
    assert world.migrated == []
    lw.tick(52.0)
    assert world.migrated == [(w.pid, (1,), (0,))]
    lw.tick(52.5)                       # the result, measured on the next tick (next due at 102.5)
    assert lw.status(f.slots[0])["local_ratio"] == 1.0
    n = len(world.sampled)
    world.ratio[w.pid] = 0.5            # the same worker drifts again: the budget's pace now
    for t in range(53, 103):
        lw.tick(float(t))
    lw.tick(102.5)
    assert len(world.sampled) == n + 1, world.sampled
    for t in range(103, 152):
        lw.tick(float(t))
    assert len(world.sampled) == n + 1 and len(world.migrated) == 1
    off = serving(1, cfg(locality_interval=1.0, repair="off"))   # report only: never sampled faster
    world2 = World()
    world2.cost, world2.ratio = 50 * CPU_BUDGET, {off.slots[0].worker.pid: 0.5}
    lw2 = watch(off, world2)
    for t in range(0, 60):
        lw2.tick(float(t))
    assert len(world2.sampled) == 2


def test_workers_due_together_are_sampled_in_one_batch_off_the_loop() -> None:
    """Workers started together fall due together: one thread samples them one after the other
    (32 small ones held the loop ~70 ms when it sampled them itself), and no second batch starts
    while one runs."""
    f = serving(4, cfg(locality_interval=10.0))
    world = World()
    held = Held(only=sample_all)
    lw = watch(f, world, offload=held)
    lw.tick(1.0)
    lw.tick(2.0)
    assert len(held.calls) == 1 and world.sampled == []
    held.finish()
    assert len(world.sampled) == 4 and len(set(world.sampled)) == 4
    lw.tick(3.0)
    assert lw.samples == 4 and all(lw.status(s)["local_ratio"] == 1.0 for s in f.slots.values())
    lw.tick(4.0)
    assert held.calls == []            # none due again before locality_interval


def test_the_budget_can_be_raised_for_a_slow_cpu_and_a_bad_value_is_ignored_by_name() -> None:
    assert LocalityWatch.budget_from({}) == CPU_BUDGET
    assert LocalityWatch.budget_from({BUDGET_ENV: "0.05"}) == 0.05
    for bad in ("lots", "0", "-1", "1.5", "nan"):
        assert LocalityWatch.budget_from({BUDGET_ENV: bad}) == CPU_BUDGET, bad
    f = serving(2, cfg(locality_interval=1.0))
    world = World()
    world.cost = 5.25 * CPU_BUDGET            # 10.5 s apart at the default budget ...
    lw = LocalityWatch(f, Operations(f, f), lambda node: (node * 2, node * 2 + 1), sampler=world.sample,
                       migrator=world.migrate, clock=lambda: 100.0, env={BUDGET_ENV: str(10 * CPU_BUDGET)},
                       offload=inline)
    for t in range(0, 4):
        lw.tick(float(t))
    assert lw.status(f.slots[0])["interval_s"] == 1.1 and lw.summary()["cpu_budget"] == 10 * CPU_BUDGET
