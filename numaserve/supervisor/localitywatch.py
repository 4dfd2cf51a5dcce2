"""Locality watch: sample every serving worker's page and thread locality, repair drift.

Each worker is sampled every ``placement.locality_interval`` seconds
(``bind.locality.sample_locality``), later when its samples cost more than
its share of ``CPU_BUDGET`` (``loops.locality.interval_for``).  The sample
goes into the worker's status (``locality``) and the metrics.  With
``placement.repair`` on, ``loops.locality.LocalityJudge`` decides from the
samples, and this shell carries it out: ``migrate`` moves the worker's pages
from the other nodes back to its own (``bind.numa.migrate_pages``, the
worker keeps serving), ``recycle`` replaces the worker make-before-break as a
tracked operation (``Operations.replace_slot``, the leak recycle's path).
Every repair is logged and counted per slot and action (across generations).

A migrate runs in a thread, off the supervision loop: the kernel copies every page, about a
second per few GiB on real hardware and 10-30 s for 200 MiB in the emulated lab VM, where the
loop it held let ``/metrics`` time out after 30 s (and would have missed systemd's watchdog).
The slot is not sampled while its migrate runs; the result is taken on a later tick.

The samples run in a thread too: reading ``numa_maps`` walks the worker's page tables in the
kernel, 74 ms for a 6 GiB worker here (as long as ``smaps_rollup``), so a model worker of tens of
GiB held the loop for most of a second per sample. The workers due at a tick are sampled one
after the other in one thread (no new batch while one runs); each sample is judged on the first
tick after the batch ended, and dropped if the slot's worker changed meanwhile.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, TypeVar

import structlog

from numaserve.bind.locality import LocalitySample, sample_locality
from numaserve.bind.numa import migrate_pages
from numaserve.loops.locality import LocalityJudge, RepairSettings, interval_for
from numaserve.supervisor.operations import Operations
from numaserve.supervisor.slotcontrol import SlotControl
from numaserve.supervisor.slots import SlotState, WorkerProc

__all__ = ["CPU_BUDGET", "LocalityWatch"]

log = structlog.get_logger("numaserve.locality")

#: Fraction of one CPU all locality samples together may take (0.2 %).  At 1 % the sampler was
#: ~80 % of an idle supervisor's CPU with 32 workers (1.1-1.6 % in all, against the 0.5 % the
#: supervisor is held to, docs/benchmarks.md § 5).  Six small workers are still sampled every
#: ``placement.locality_interval`` (10 s); 32 small ones about every 50 s, larger ones less often.
CPU_BUDGET = 0.002
#: Overrides ``CPU_BUDGET`` (a fraction of one CPU in (0, 1]): where a CPU is far slower than the
#: hardware the budget was set for, e.g. the emulated 2-node lab VM, whose samples cost 50-400x
#: more CPU and were spaced 100-400 s apart (its locality test: docs/testing.md).
BUDGET_ENV = "NUMASERVE_LOCALITY_CPU_BUDGET"
#: A sample batch still running after this many seconds is logged once (``locality_sample_stuck``):
#: a ``numa_maps`` read can hang on a process stuck in the kernel, and no other sample starts
#: meanwhile.  Normal batches take milliseconds (seconds in the emulated lab VM).
STUCK_AFTER_S = 120.0

Sampler = Callable[[int, tuple[int, ...], tuple[int, ...]], LocalitySample]
Migrator = Callable[[int, tuple[int, ...], tuple[int, ...]], int]
#: Runs a blocking call off the supervision loop; its Future may already be done (tests run it inline).
Offload = Callable[[Callable[[], Any]], "Future[Any]"]

T = TypeVar("T")


def in_thread(fn: Callable[[], T]) -> Future[T]:
    """``fn`` in a daemon thread (a migrate or a sample every few seconds at most: no pool kept).
    ctypes drops the GIL for the migrate syscall, file reads drop it for the kernel's page-table
    walk, so the loop runs on meanwhile."""
    fut: Future[T] = Future()

    def body() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as e:  # handed to the loop with the result
            fut.set_exception(e)

    threading.Thread(target=body, name="ns-locality", daemon=True).start()
    return fut


@dataclass
class _Migration:
    """A migrate running off the loop."""

    slot: SlotState
    worker: WorkerProc
    sample: LocalitySample
    src: tuple[int, ...]
    started: float
    future: Future[int]


@dataclass
class _Batch:
    """The samples of the workers due at one tick, running off the loop."""

    due: list[tuple[SlotState, WorkerProc, "_Seen"]]
    future: Future[list[LocalitySample | Exception]]
    at: float                      # the tick that started it: when the samples were taken
    warned: bool = False           # logged as stuck


def sample_all(calls: list[Callable[[], LocalitySample]]) -> list[LocalitySample | Exception]:
    """Each sample in turn (in the offload's thread); an unreadable worker's error is its result."""
    out: list[LocalitySample | Exception] = []
    for call in calls:
        try:
            out.append(call())
        except (OSError, ValueError) as e:
            out.append(e)
    return out


@dataclass
class _Seen:
    """The last sample of a slot's current worker and when the next one is due."""

    pid: int
    generation: int
    sample: LocalitySample | None = None
    at: float = 0.0
    due: float = 0.0
    interval: float = 0.0


class LocalityWatch:
    """Owns the locality samples and repairs; the supervisor calls ``tick`` about once a second."""

    def __init__(self, ctl: SlotControl, operations: Operations, node_cpus: Callable[[int], tuple[int, ...]], *,
                 sampler: Sampler = sample_locality, migrator: Migrator = migrate_pages,
                 clock: Callable[[], float] = time.monotonic, env: Mapping[str, str] = os.environ,
                 offload: Offload = in_thread) -> None:
        self.ctl = ctl
        self.budget = self.budget_from(env)
        self.operations = operations
        self.node_cpus = node_cpus
        self.sampler = sampler
        self.migrator = migrator
        self.offload = offload
        self.migrating: dict[int, _Migration] = {}               # slot -> its migrate in a thread
        self.sampling: _Batch | None = None                       # the samples running in a thread
        self.clock = clock
        self.seen: dict[int, _Seen] = {}
        self.judge = LocalityJudge(self._settings())
        self.repairs: dict[int, dict[str, int]] = {}            # slot -> action -> count (all generations)
        self.history: dict[int, deque[dict[str, Any]]] = {}     # slot -> the last repairs
        self.cost_s = 0.0                                         # CPU time of every sample taken
        self.samples = 0

    @staticmethod
    def budget_from(env: Mapping[str, str]) -> float:
        """``CPU_BUDGET``, or ``BUDGET_ENV`` when it holds a fraction in (0, 1] (else a warning
        naming the variable, and the default)."""
        raw = env.get(BUDGET_ENV, "").strip()
        if not raw:
            return CPU_BUDGET
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if 0.0 < value <= 1.0:
            return value
        log.warning("locality_budget_ignored", variable=BUDGET_ENV, value=raw,
                    why="expected a fraction of one CPU in (0, 1]", using=CPU_BUDGET)
        return CPU_BUDGET

    def _settings(self) -> RepairSettings:
        p = self.ctl.cfg.placement
        return RepairSettings(p.repair, p.repair_threshold, p.repair_hold)

    @staticmethod
    def own_nodes(slot: SlotState) -> tuple[int, ...]:
        """The nodes a slot's pages belong on: its memory nodes, or its node under "local"."""
        return tuple(slot.plan.memory_nodes) or (slot.plan.node,)

    # ----------------------------------------------------------------- sampling

    def tick(self, now: float) -> None:
        base = self.ctl.cfg.placement.locality_interval
        self._finished(now)
        if base <= 0 or self.ctl.stopping:
            return
        settings = self._settings()
        if settings != self.judge.settings:      # a reload changed the repair keys
            self.judge.settings = settings
        workers = sum(1 for s in self.ctl.slots.values() if s.worker is not None)
        self._sampled(now, base, workers)
        due: list[tuple[SlotState, WorkerProc, _Seen]] = []
        for slot in self.ctl.slots.values():
            w = slot.worker
            if w is None or w.popen.poll() is not None or (w.hello is None and not w.external):
                continue
            seen = self.seen.get(slot.plan.slot)
            if seen is None or seen.pid != w.pid or seen.generation != w.generation:
                seen = self.seen[slot.plan.slot] = _Seen(w.pid, w.generation)
            if now >= seen.due and slot.plan.slot not in self.migrating:
                due.append((slot, w, seen))
        if due and self.sampling is None:
            self._start_samples(due, now, base, workers)
        live = {s.plan.slot for s in self.ctl.slots.values() if s.worker is not None}
        for n in [n for n in self.seen if n not in live]:
            del self.seen[n]
        self.judge.forget(live)

    def _start_samples(self, due: list[tuple[SlotState, WorkerProc, _Seen]], now: float, base: float,
                       workers: int) -> None:
        """Sample the due workers off the loop; judged now if the offload already ran them (tests),
        else on the tick after the batch ends."""
        calls = []
        for slot, w, _ in due:
            nodes = self.own_nodes(slot)
            cpus: tuple[int, ...] = ()
            for n in nodes:
                cpus += self.node_cpus(n)
            calls.append(partial(self.sampler, w.pid, nodes, cpus or tuple(slot.plan.cpus)))
        batch = _Batch(due, self.offload(partial(sample_all, calls)), now)
        if batch.future.done():
            self._judge_all(batch, now, base, workers)
        else:
            self.sampling = batch

    def _sampled(self, now: float, base: float, workers: int) -> None:
        """Judge the batch that ended since the last tick."""
        batch = self.sampling
        if batch is None:
            return
        if batch.future.done():
            self.sampling = None
            self._judge_all(batch, now, base, workers)
        elif not batch.warned and now - batch.at >= STUCK_AFTER_S:
            batch.warned = True
            log.warning("locality_sample_stuck", seconds=round(now - batch.at, 1),
                        slots=[slot.plan.slot for slot, _, _ in batch.due],
                        pids=[w.pid for _, w, _ in batch.due],
                        why="reading /proc/PID/numa_maps has not returned; no worker is sampled until it does")

    def _judge_all(self, batch: _Batch, now: float, base: float, workers: int) -> None:
        """Judge each sample of a batch, unless its slot's worker is gone or was replaced meanwhile."""
        for (slot, w, seen), got in zip(batch.due, batch.future.result()):
            if slot.worker is w and self.seen.get(slot.plan.slot) is seen:
                self._judge(slot, w, seen, got, batch.at, now, base, workers)

    def _judge(self, slot: SlotState, w: WorkerProc, seen: _Seen, sample: LocalitySample | Exception,
               at: float, now: float, base: float, workers: int) -> None:
        """Record a finished sample (taken at ``at``), judge it, repair if due.  The next one is
        due an interval after this one was taken, not after it was judged: a batch judged on the
        next tick would otherwise make every interval a tick longer (every other tick at 1 s)."""
        if isinstance(sample, Exception):
            seen.due = at + base
            log.debug("locality_unreadable", slot=slot.plan.slot, pid=w.pid, error=str(sample))
            return
        self.cost_s += sample.cost_s
        self.samples += 1
        seen.sample, seen.at = sample, at
        seen.interval = interval_for(base, sample.cost_s, workers, self.budget)
        seen.due = at + seen.interval
        ratio = sample.local_ratio
        action = self.judge.observe(slot.plan.slot, w.generation, ratio)
        if action is None and self._confirming(slot, w):
            seen.due = at + base
        if action == "migrate":
            self._migrate(slot, w, sample, now)
        elif action == "recycle":
            self._recycle(slot, w, sample)

    def _confirming(self, slot: SlotState, w: WorkerProc) -> bool:
        """The worker is low and counting towards a repair it never had: its next sample comes
        at ``locality_interval``, not at the budget's stretched interval.  The hold counts
        samples, and stretched ones made a repair wait ``repair_hold`` times minutes (the 2-node
        lab VM: ~100 s per sample, 10 min to a migrate).  At most ``repair_hold - 1`` such samples
        per worker: once it was repaired, a worker that drifts again waits the budget's interval."""
        if self.judge.settings.mode == "off" or not self.judge.low_samples(slot.plan.slot):
            return False
        return not any(r["pid"] == w.pid for r in self.history.get(slot.plan.slot, ()))

    # ------------------------------------------------------------------ repairs

    def _record(self, slot: SlotState, w: WorkerProc, action: str, sample: LocalitySample, **fields: Any) -> None:
        counts = self.repairs.setdefault(slot.plan.slot, {})
        counts[action] = counts.get(action, 0) + 1
        entry = {"action": action, "pid": w.pid, "generation": w.generation,
                 "local_ratio": round(sample.local_ratio or 0.0, 4), "at": time.time(), **fields}
        self.history.setdefault(slot.plan.slot, deque(maxlen=5)).append(entry)
        self.judge.repaired(slot.plan.slot)

    def _migrate(self, slot: SlotState, w: WorkerProc, sample: LocalitySample, now: float) -> None:
        src = sample.remote_nodes()
        if not src:
            return
        pid, nodes = w.pid, sample.nodes
        job = _Migration(slot, w, sample, src, time.monotonic(),
                         self.offload(partial(self.migrator, pid, src, nodes)))
        if job.future.done():
            self._settle(job, now)
        else:
            self.migrating[slot.plan.slot] = job

    def _finished(self, now: float) -> None:
        """Take the migrates that ended since the last tick."""
        for n, job in list(self.migrating.items()):
            if job.future.done():
                del self.migrating[n]
                self._settle(job, now)

    def _settle(self, job: _Migration, now: float) -> None:
        slot, w, sample = job.slot, job.worker, job.sample
        took = round(time.monotonic() - job.started, 4)
        try:
            left = job.future.result()
        except (OSError, ValueError) as e:
            log.error("locality_repair_failed", slot=slot.plan.slot, pid=w.pid, action="migrate",
                      local_ratio=round(sample.local_ratio or 0.0, 4), error=str(e))
            self._record(slot, w, "migrate", sample, result="failed", error=str(e))
            return
        log.warning("locality_repair", slot=slot.plan.slot, pid=w.pid, action="migrate",
                    local_ratio=round(sample.local_ratio or 0.0, 4), from_nodes=list(job.src),
                    to_nodes=list(sample.nodes), pages_not_moved=left, seconds=took)
        self._record(slot, w, "migrate", sample, result="ok", pages_not_moved=left, seconds=took)
        seen = self.seen.get(slot.plan.slot)
        if seen is not None and seen.pid == w.pid:
            seen.due = now   # measure the result on the next tick

    def _recycle(self, slot: SlotState, w: WorkerProc, sample: LocalitySample) -> None:
        cur = self.operations.current
        if cur is not None and cur.state == "running":
            log.info("locality_repair_deferred", slot=slot.plan.slot, pid=w.pid, action="recycle",
                     why=f"operation {cur.id} running")
            return
        ratio = round(sample.local_ratio or 0.0, 4)
        reason = f"locality: {ratio:.1%} of its anonymous memory on node(s) {','.join(map(str, sample.nodes))}"
        try:
            self.operations.start("locality", {"slot": slot.plan.slot, "reason": reason}, [slot.plan.slot],
                                  lambda op: self.operations.recycle(op, slot, reason))
        except Exception as e:  # another operation won the race: asked again on the next low sample
            log.info("locality_repair_deferred", slot=slot.plan.slot, pid=w.pid, action="recycle", why=str(e))
            return
        log.warning("locality_repair", slot=slot.plan.slot, pid=w.pid, action="recycle", local_ratio=ratio)
        self._record(slot, w, "recycle", sample, result="started")

    # ------------------------------------------------------------------- status

    def summary(self) -> dict[str, Any]:
        """What the sampling has cost so far (the supervisor's ``locality`` in status): the CPU
        seconds of every sample, so ``rate()`` of it shows the share of a CPU against the budget."""
        return {"samples": self.samples, "cpu_s": round(self.cost_s, 6), "cpu_budget": self.budget,
                "interval_s": self.ctl.cfg.placement.locality_interval, "repair": self.judge.settings.mode}

    def status(self, slot: SlotState) -> dict[str, Any]:
        """The slot's ``locality`` in status (and the metrics' source)."""
        seen = self.seen.get(slot.plan.slot)
        s = seen.sample if seen else None
        ratio = s.local_ratio if s else None
        return {
            "nodes": list(self.own_nodes(slot)),
            "local_ratio": round(ratio, 4) if ratio is not None else None,
            "anon_bytes": s.total_bytes if s else None,
            "remote_anon_bytes": s.remote_bytes if s else None,
            "threads": s.threads if s else None,
            "threads_off_node": s.threads_off_node if s else None,
            "sampled_s_ago": round(self.clock() - seen.at, 1) if s and seen else None,
            "interval_s": round(seen.interval, 1) if s and seen else None,
            "low_samples": self.judge.low_samples(slot.plan.slot),
            "repair": self.judge.settings.mode,
            "repairs": dict(self.repairs.get(slot.plan.slot, {})),
            "last_repairs": list(self.history.get(slot.plan.slot, ())),
        }
