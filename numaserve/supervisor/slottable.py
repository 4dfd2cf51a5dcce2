"""The slot table: the one owner of slot and worker lifecycle state, and its verbs.

Everything that changes a slot goes through a verb here, or through
``lifecycle.Lifecycle`` (the table with the loop's own judgments: reap,
backoff, watchdog, readiness), so nothing else writes a slot's state:

    start:                        start_worker → (Ready) on_ready → mark_ready
    restart (make before break):  start_incoming → (wait ready) → promote → retire
    drain / undrain:              begin_drain → retire each worker → end_drain;  undrain
    stop:                         begin_stop → stop_all (or kill_all) → settle_stopped

A test (``tests/unit/supervisor/test_slot_writers.py``) fails when another
module stores to a slot's or worker's lifecycle fields.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from typing import Callable

import structlog

from numaserve.bind.placement import SlotPlan
from numaserve.config import Config
from numaserve.control import messages as m
from numaserve.errors import NumaserveError
from numaserve.supervisor import exits as X
from numaserve.supervisor import slots as S
from numaserve.supervisor.loadwatch import LoadProgress

__all__ = ["SendMessage", "SlotTable", "SpawnWorker"]

log = structlog.get_logger("numaserve.supervisor")

#: (live config, slot plan, generation, now) -> the started worker; raises OSError/NumaserveError.
SpawnWorker = Callable[[Config, SlotPlan, int, float], S.WorkerProc]
#: (worker, message) -> sent without waiting (``channel.WorkerChannel.send_soon``).
SendMessage = Callable[[S.WorkerProc, m.Msg], None]


class SlotTable:
    """Every slot's state and the verbs that change it; ``lifecycle.Lifecycle`` adds the loop's judgments.

    ``spawn_failed`` is the one judgment a verb needs (a spawn that raised): the lifecycle decides it.
    """

    def __init__(self, cfg: Config, slots: dict[int, S.SlotState], *, spawn_worker: SpawnWorker,
                 wake: asyncio.Event, started: float, send_message: SendMessage,
                 send_signal: Callable[[int, int], None] = os.kill,
                 on_spawn_error: Callable[[BaseException], None] = lambda e: None,
                 cgroup_of: Callable[[int], str | None] = X.cgroup_dir) -> None:
        self.cfg = cfg                      # the live config (a reload replaces it)
        self.slots = slots
        self.spawn_worker = spawn_worker
        self.wake = wake
        self.started = started
        self.send_message = send_message
        self.send_signal = send_signal
        self.on_spawn_error = on_spawn_error
        self.cgroup_of = cgroup_of
        self.stopping = False
        self.forced_kills = False

    def spawn_failed(self, slot: S.SlotState, now: float, error: BaseException) -> None:
        raise NotImplementedError("the lifecycle judges a failed spawn")

    # ---------------------------------------------------------- spawn, ready

    def spawn_generation(self, slot: S.SlotState, now: float) -> S.WorkerProc:
        """Start the slot's next generation (raises OSError/NumaserveError)."""
        slot.generation += 1
        w = self.spawn_worker(self.cfg, slot.plan, slot.generation, now)
        if not w.external:
            w.load = LoadProgress.begin(w.started)
            w.cgroup = self.cgroup_of(w.pid)
            w.oom_base = X.cgroup_oom_kills(w.cgroup) if w.cgroup else None
        return w

    def start_worker(self, slot: S.SlotState, now: float) -> None:
        try:
            slot.worker = self.spawn_generation(slot, now)
        except (OSError, NumaserveError) as e:
            log.error("spawn_failed", slot=slot.plan.slot, error=str(e))
            self.on_spawn_error(e)
            self.spawn_failed(slot, now, e)
            return
        slot.state = S.STARTING
        slot.next_retry = None

    def on_ready(self, slot: S.SlotState, w: S.WorkerProc, now: float) -> None:
        if w.ready is not None:
            return
        w.ready = now
        w.ready_evt.set()
        self.forget_progress(w)
        if w is slot.worker and not self.stopping and w.stop_sent is None:
            self.mark_ready(slot, now)
        elif w is slot.incoming:
            log.info("worker_ready", slot=slot.plan.slot, pid=w.pid, generation=w.generation,
                     boot_s=round(now - w.started, 3), role="incoming",
                     **({"probe": w.probe_note} if w.external else {}))

    def mark_ready(self, slot: S.SlotState, now: float) -> None:
        slot.state = S.READY
        slot.ever_ready = True
        slot.down_since = None
        slot.failed_reason = None
        slot.next_retry = None
        if slot.retrying:  # a failed slot came back: its crash history is over
            slot.retrying = False
            slot.restart.reset()
        w = slot.worker
        log.info(
            "worker_ready",
            slot=slot.plan.slot,
            pid=w.pid if w else None,
            generation=w.generation if w else None,
            boot_s=round(now - w.started, 3) if w else None,
            **({"probe": w.probe_note} if w and w.external else {}),
        )

    @staticmethod
    def forget_progress(w: S.WorkerProc) -> None:
        """The progress file is only read while the worker loads: remove it once it is ready or gone."""
        if w.progress_path:
            try:
                os.unlink(w.progress_path)
            except OSError:
                pass
            w.progress_path = None

    def kill(self, w: S.WorkerProc, now: float) -> None:
        self.signal(w, signal.SIGKILL)
        w.kill_sent = now

    def signal(self, w: S.WorkerProc, sig: int) -> None:
        try:
            self.send_signal(w.pid, sig)
        except ProcessLookupError:
            pass

    # ------------------------------------------------------------ operations

    def claim(self, slot: S.SlotState, op_id: str) -> None:
        """An operation works on the slot now (status shows its id)."""
        slot.operation = op_id

    def release(self, slot: S.SlotState, op_id: str) -> None:
        if slot.operation == op_id:
            slot.operation = None

    def note_restart_reason(self, slot: S.SlotState, reason: str) -> None:
        """Why the next replacement happens (a leak, an age limit, locality): shown in status."""
        slot.last_restart_reason = reason

    def start_fresh(self, slot: S.SlotState, now: float) -> S.WorkerProc | None:
        """Nothing serves (backoff, failed): start the slot now, its crash history forgotten.

        A failed slot gets one attempt (it fails again at once if that fails, and is retried
        on the long backoff as before).  Returns the new worker, None when the spawn failed."""
        was_failed = slot.state == S.FAILED
        slot.restart.reset()
        if slot.worker is None:
            slot.retrying = was_failed
            self.start_worker(slot, now)
        return slot.worker

    def start_incoming(self, slot: S.SlotState, now: float) -> S.WorkerProc:
        """The slot's next generation, beside the serving one (raises OSError/NumaserveError)."""
        new = self.spawn_generation(slot, now)
        slot.incoming = new
        return new

    def promote(self, slot: S.SlotState, now: float, why: str) -> S.WorkerProc:
        """The Ready incoming worker serves the slot (same listener); the old one is retiring.

        ``why`` (restart, reload, leak, ...) is counted in the slot's restarts by reason.
        Returns the old worker, for ``retire``."""
        new, old = slot.incoming, slot.worker
        assert new is not None and old is not None, "promote without an incoming and a serving worker"
        slot.incoming = None
        slot.worker = new
        slot.retiring.append(old)
        self.mark_ready(slot, now)
        rb = slot.totals_before.restarts_by_reason
        rb[why] = rb.get(why, 0) + 1
        return old

    def retire(self, slot: S.SlotState, w: S.WorkerProc, now: float, deadline: float) -> None:
        """Tell one worker to drain: it stops accepting and exits within ``deadline`` s."""
        self.send_stop(slot, w, now, deadline, drain=True)

    def abort(self, w: S.WorkerProc, reason: str, now: float) -> None:
        """Kill a worker for ``reason`` (an aborted replacement, a hard memory cap); the reaper accounts for it."""
        w.kill_reason = w.kill_reason or reason
        self.kill(w, now)

    def refuse(self, w: S.WorkerProc, reason: str) -> None:
        """SIGTERM a worker proven to be ours that cannot serve (a control protocol mismatch)."""
        w.kill_reason = reason
        self.signal(w, signal.SIGTERM)

    def send_stop(self, slot: S.SlotState, w: S.WorkerProc, now: float, deadline: float, *, drain: bool) -> None:
        """Ask one worker to finish in-flight work within ``deadline`` s and exit.

        ``drain``: Drain (it stops accepting at once) rather than Stop; both end
        with the worker exiting.  External commands get SIGTERM.
        """
        if w.stop_sent is not None:
            return
        w.stop_sent = now
        w.stop_deadline = deadline
        if w.identity is not None and not w.external:
            self.send_message(w, (m.Drain if drain else m.Stop)(id=uuid.uuid4().hex[:12], deadline=deadline))
        elif w.external or w.hello is None:
            # no control channel (yet): an external command, or a worker still booting
            self.signal(w, signal.SIGTERM)

    # ----------------------------------------------------------------- drain

    def begin_drain(self, slot: S.SlotState) -> None:
        """Out of service by the operator: no new connections; a serving worker is draining."""
        slot.drained = True
        if slot.worker is not None and slot.state == S.READY:
            slot.state = S.DRAINING

    def end_drain(self, slot: S.SlotState) -> None:
        if slot.worker is None:
            slot.state = S.DRAINED

    def undrain(self, slot: S.SlotState, now: float) -> S.WorkerProc | None:
        """Back in service: a slot without a worker starts one (returned); a draining one serves again."""
        slot.drained = False
        if slot.worker is None:
            slot.restart.reset()
            slot.failed_reason = None
            self.start_worker(slot, now)
            return slot.worker
        if slot.state == S.DRAINING:
            slot.state = S.READY   # drain never got to stop it: it is still serving
        return None

    # ------------------------------------------------------------------ stop

    def begin_stop(self) -> bool:
        """Readiness off (``stopping``); True the first time."""
        first = not self.stopping
        self.stopping = True
        return first

    def kill_all(self, now: float) -> None:
        """A fast stop: every live worker is killed (counted as forced)."""
        for slot in self.slots.values():
            for w in slot.workers():
                if w.popen.poll() is None and w.kill_sent is None:
                    self.kill(w, now)
                    self.forced_kills = True

    def stop_all(self, now: float, deadline: float) -> None:
        """Every slot stopping: each worker not yet told is sent Stop with ``deadline``."""
        for slot in self.slots.values():
            if slot.worker is not None:
                slot.state = S.STOPPING
            for w in slot.workers():
                if w.stop_sent is None and w.kill_sent is None:
                    self.send_stop(slot, w, now, deadline, drain=False)

    def settle_stopped(self) -> bool:
        """Slots without a worker count as stopped; True once no worker is left."""
        for slot in self.slots.values():
            if slot.worker is None and slot.state not in (S.STOPPED, S.FAILED, S.DRAINED):
                slot.state = S.STOPPED
        return not any(True for s in self.slots.values() for _ in s.workers())
