"""The slot table: the one owner of slot and worker lifecycle state.

``Lifecycle`` (its base) runs what the supervision loop does on its own:
spawn, reap, backoff, watchdog, readiness.  The table adds what operators and
the guards ask for, as verbs, so nothing else writes a slot's state:

    restart (make before break):  start_incoming → (wait ready) → promote → retire
    drain / undrain:              begin_drain → retire each worker → end_drain;  undrain
    stop:                         begin_stop → stop_all (or kill_all) → settle_stopped

A test (``tests/unit/supervisor/test_slot_writers.py``) fails when another
module stores to a slot's or worker's lifecycle fields.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from typing import Any, Callable

from numaserve.config import Config
from numaserve.control import messages as m
from numaserve.supervisor import slots as S
from numaserve.supervisor.backoff import RestartPolicy
from numaserve.supervisor.lifecycle import Lifecycle, SpawnWorker

__all__ = ["SlotTable", "SendMessage"]

#: (worker, message) -> sent without waiting (``channel.WorkerChannel.send_soon``).
SendMessage = Callable[[S.WorkerProc, m.Msg], None]


class SlotTable(Lifecycle):
    """Every slot's state and its transitions; the supervisor, operations, guards and stop use its verbs."""

    def __init__(self, cfg: Config, slots: dict[int, S.SlotState], policy: RestartPolicy, *,
                 spawn_worker: SpawnWorker, wake: asyncio.Event, started: float, send_message: SendMessage,
                 **seams: Any) -> None:
        super().__init__(cfg, slots, policy, spawn_worker=spawn_worker, wake=wake, started=started, **seams)
        self.send_message = send_message

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
