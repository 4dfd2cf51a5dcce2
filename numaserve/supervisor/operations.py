"""Tracked, readiness-gated operations: drain, undrain, restart, reload.

Every operation has an id, a list of steps with timestamps, and ends
``succeeded`` or ``failed`` with a reason; ``status`` and ``numaserve ...
--wait`` read it.  One mutating operation runs at a time (a second one is
refused, never interleaved).

Rolling replacement of a slot (restart, reload, leak recycling) is make
before break on the *same* listener: the new generation starts and must
report Ready; only then does the old one get Drain (it stops accepting and
finishes its in-flight requests).  The listener never closes, so nothing
queued is lost, and capacity never drops below the plan.  If the new worker
fails, it is killed, the old one keeps serving, and the operation fails with
the reason.

Drain is steer-then-stop: the CBPF program first keeps new connections off
the slot, the worker keeps accepting until the slot's accept queue is empty,
then it is told to drain.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from numaserve.errors import NumaserveError
from numaserve.supervisor import slots as S
from numaserve.supervisor.slotcontrol import Routing, SlotControl

log = structlog.get_logger("numaserve.operations")

RUNNING, SUCCEEDED, FAILED = "running", "succeeded", "failed"
MAX_KEPT = 32


class OperationFailed(NumaserveError):
    pass


@dataclass
class Operation:
    kind: str
    args: dict[str, Any]
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    state: str = RUNNING
    started: float = field(default_factory=time.time)
    finished: float | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)
    result: str = ""
    slots: list[int] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    on_finish: list[Callable[[Operation], None]] = field(default_factory=list)

    def step(self, message: str, **fields: Any) -> None:
        entry = {"t": round(time.time() - self.started, 3), "message": message, **fields}
        self.steps.append(entry)
        log.info("operation_step", op=self.id, kind=self.kind, step=message, **fields)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind,
            "args": self.args,
            "state": self.state,
            "started": self.started,
            "finished": self.finished,
            "elapsed_s": round((self.finished or time.time()) - self.started, 3),
            "slots": self.slots,
            "steps": self.steps,
            "result": self.result,
        }


class Operations:
    """The supervisor's operation registry and runner."""

    def __init__(self, ctl: SlotControl, routing: Routing) -> None:
        self.ctl = ctl
        self.routing = routing
        self.ops: dict[str, Operation] = {}
        self.current: Operation | None = None

    def get(self, op_id: str) -> Operation | None:
        return self.ops.get(op_id)

    def recent(self) -> list[dict[str, Any]]:
        return [o.to_json() for o in list(self.ops.values())[-8:]]

    def start(self, kind: str, args: dict[str, Any], slots: list[int],
              body: Callable[[Operation], Awaitable[str]]) -> Operation:
        if self.current is not None and self.current.state == RUNNING:
            raise NumaserveError(
                f"operation {self.current.id} ({self.current.kind}) is still running; "
                f"wait for it (`numaserve operation {self.current.id} --wait`)"
            )
        if self.ctl.stopping:
            raise NumaserveError("the supervisor is stopping")
        op = Operation(kind=kind, args=args, slots=slots)
        self.ops[op.id] = op
        while len(self.ops) > MAX_KEPT:
            self.ops.pop(next(iter(self.ops)))
        self.current = op
        op.step("started", slots=slots)
        asyncio.get_running_loop().create_task(self._run(op, body))
        return op

    async def _run(self, op: Operation, body: Callable[[Operation], Awaitable[str]]) -> None:
        try:
            op.result = await body(op)
            op.state = SUCCEEDED
        except OperationFailed as e:
            op.state, op.result = FAILED, str(e)
        except asyncio.CancelledError:
            op.state, op.result = FAILED, "cancelled (supervisor stopping)"
            raise
        except Exception as e:  # a bug must fail the operation, not the supervisor
            log.exception("operation_error", op=op.id)
            op.state, op.result = FAILED, f"internal error: {type(e).__name__}: {e}"
        finally:
            op.finished = time.time()
            for s in op.slots:
                slot = self.ctl.slots.get(s)
                if slot is not None:
                    self.ctl.release(slot, op.id)
            op.step(op.state, result=op.result)
            for cb in op.on_finish:
                try:
                    cb(op)
                except Exception:
                    log.exception("operation_callback_error", op=op.id)
            op.done.set()
            self.ctl.wake.set()

    # ------------------------------------------------------------ procedures

    async def recycle(self, op: Operation, slot: S.SlotState, reason: str) -> str:
        """Replace one slot's worker for ``reason`` (a leak, an age limit, poor locality)."""
        self.ctl.note_restart_reason(slot, reason)
        await self.replace_slot(op, slot, self.ctl.cfg.server.graceful_timeout)
        return f"slot {slot.plan.slot} recycled ({reason})"

    async def replace_slot(self, op: Operation, slot: S.SlotState, timeout: float) -> None:
        """Make-before-break: new generation Ready on the same listener, then drain the old."""
        drained = await self.switch_slot(op, slot, timeout)
        if drained is not None:
            await drained

    async def switch_slot(self, op: Operation, slot: S.SlotState,
                          timeout: float) -> Awaitable[None] | None:
        """Start incoming, wait ready, promote, retire: the slot's new generation serves, the old one drains.

        Returns the wait for the old worker's exit (None when there was none), so a roll can
        start the next slot while this one's old worker finishes its in-flight requests: the
        slot is never without a Ready worker, and the old one stops accepting only once its
        replacement serves.
        """
        ctl = self.ctl
        s = slot.plan.slot
        ctl.claim(slot, op.id)
        if slot.drained:
            op.step(f"slot {s}: drained, left out of service", slot=s)
            return None
        old = slot.worker
        if old is None or slot.state != S.READY:
            was = slot.state
            new = ctl.start_fresh(slot, time.monotonic())
            if new is None:
                raise OperationFailed(f"slot {s}: could not spawn: {slot.last_restart_reason}")
            op.step(f"slot {s}: started generation {new.generation} (slot was {was})", slot=s, pid=new.pid)
            await self._wait_ready(op, slot, new)
            return None
        try:
            new = ctl.start_incoming(slot, time.monotonic())
        except (OSError, NumaserveError) as e:
            raise OperationFailed(f"slot {s}: could not spawn the new worker: {e}; old worker kept") from None
        op.step(f"slot {s}: generation {new.generation} starting beside {old.generation}", slot=s, pid=new.pid)
        await self._wait_ready(op, slot, new)
        ctl.promote(slot, time.monotonic(), op.kind)
        ctl.retire(slot, old, time.monotonic(), timeout)
        op.step(f"slot {s}: generation {new.generation} ready; draining {old.generation}", slot=s,
                old_pid=old.pid)
        return self._wait_exit(op, slot, old, timeout + self.ctl.cfg.supervisor.stop_timeout + 5.0)

    async def _wait_exit(self, op: Operation, slot: S.SlotState, old: S.WorkerProc, limit: float) -> None:
        s = slot.plan.slot
        try:
            await asyncio.wait_for(old.exit_evt.wait(), limit)
        except TimeoutError:
            raise OperationFailed(f"slot {s}: old worker pid {old.pid} did not exit") from None
        op.step(f"slot {s}: generation {old.generation} exited ({old.exit_cause})", slot=s)

    async def _wait_ready(self, op: Operation, slot: S.SlotState, new: S.WorkerProc) -> None:
        ctl = self.ctl
        limit = ctl.cfg.supervisor.ready_timeout
        try:
            # no deadline (0): a load ends in Ready or an exit (the watchdog kills a stalled one)
            await asyncio.wait_for(new.ready_evt.wait(), limit + 1.0 if limit > 0 else None)
        except TimeoutError:
            pass
        if new.ready is None or new.exit_code is not None:
            why = new.exit_cause or new.kill_reason or f"not ready within {limit:g}s (supervisor.ready_timeout)"
            if new.popen.poll() is None:   # the reaper accounts for it; the old worker keeps serving
                ctl.abort(new, "replacement aborted", time.monotonic())
            raise OperationFailed(
                f"slot {slot.plan.slot}: new worker (generation {new.generation}) failed: {why}; "
                + ("old worker kept serving" if slot.worker is not new else "slot not serving")
            )

    async def drain_slots(self, op: Operation, slots: list[S.SlotState], timeout: float) -> str:
        ctl = self.ctl
        deadline = time.monotonic() + timeout
        routing = self.routing
        for slot in slots:
            ctl.claim(slot, op.id)
            ctl.begin_drain(slot)
        routing.steer()  # no new connections for these slots from now on
        op.step("steered new connections away", healthy=routing.healthy_slots())
        if not routing.healthy_slots():
            op.step("warning: no slot left serving: new connections queue until undrain")
        # let the worker take what is already queued (bounded), then a round trip of grace
        settle = min(5.0, max(0.2, timeout / 4))
        end = time.monotonic() + settle
        while time.monotonic() < end:
            depth = routing.queued(sl.plan.slot for sl in slots)
            if depth == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        now = time.monotonic()
        waits = []
        for slot in slots:
            for w in list(slot.workers()):
                if w.popen.poll() is None:
                    ctl.retire(slot, w, now, max(0.1, deadline - now))
                    waits.append((slot, w))
        op.step("told workers to drain", workers=[w.pid for _, w in waits])
        left = []
        for slot, w in waits:
            remaining = deadline - time.monotonic()
            try:
                await asyncio.wait_for(w.exit_evt.wait(), max(0.05, remaining))
            except TimeoutError:
                inflight = w.stats.inflight if w.stats else None
                left.append(f"slot {slot.plan.slot} pid {w.pid} ({inflight} in flight)")
        for slot in slots:
            ctl.end_drain(slot)
        if left:
            raise OperationFailed(f"timeout after {timeout:g}s with work left: " + ", ".join(left))
        return f"drained slots {[s.plan.slot for s in slots]}"

    async def undrain_slots(self, op: Operation, slots: list[S.SlotState]) -> str:
        ctl = self.ctl
        waits = []
        for slot in slots:
            ctl.claim(slot, op.id)
            w = ctl.undrain(slot, time.monotonic())
            if w is not None:
                waits.append((slot, w))
                op.step(f"slot {slot.plan.slot}: starting generation {w.generation}")
        for slot, w in waits:
            await self._wait_ready(op, slot, w)
        self.routing.steer()
        return f"serving slots {[s.plan.slot for s in slots]}"

    # The ops verbs' operations: each names its slots and its body (``numaserve.supervisor.ops``
    # checks the arguments and renders the ``Operation`` these return).

    def drain(self, args: dict[str, Any], slots: list[S.SlotState], timeout: float) -> Operation:
        """The ``drain`` operation: take ``slots`` out of rotation, waiting up to ``timeout`` for their requests."""
        return self.start("drain", args, [s.plan.slot for s in slots],
                          lambda op: self.drain_slots(op, slots, timeout))

    def undrain(self, args: dict[str, Any], slots: list[S.SlotState]) -> Operation:
        """The ``undrain`` operation: put ``slots`` back into rotation."""
        return self.start("undrain", args, [s.plan.slot for s in slots], lambda op: self.undrain_slots(op, slots))

    def restart(self, args: dict[str, Any], slots: list[S.SlotState], timeout: float) -> Operation:
        """The ``restart`` operation: replace ``slots`` make-before-break, ``ops.reload_parallel`` at a time."""
        return self.start("restart", args, [s.plan.slot for s in slots],
                          lambda op: self.roll(op, slots, timeout, self.ctl.cfg.ops.reload_parallel))

    async def roll(self, op: Operation, slots: list[S.SlotState], timeout: float, parallel: int) -> str:
        """Replace slots ``parallel`` at a time; stop at the first failure.

        Overlapped: the next batch starts as soon as this batch's new workers are Ready and
        their old ones were told to drain, not when the old ones have exited (draining costs
        no capacity: the slot's new worker already serves).  At most ``parallel`` slots have
        a replacement starting at once, and no slot's old worker stops accepting before its
        own replacement is Ready.  The operation ends when every old worker has exited.
        """
        done = 0
        step = max(1, parallel)
        exits: list[asyncio.Task[None]] = []
        try:
            for i in range(0, len(slots), step):
                batch = slots[i:i + step]
                results = await asyncio.gather(*(self.switch_slot(op, s, timeout) for s in batch),
                                               return_exceptions=True)
                failure: BaseException | None = None
                for r in results:
                    if isinstance(r, BaseException):
                        failure = failure or r
                    elif r is not None:
                        exits.append(asyncio.ensure_future(r))
                if failure is not None:
                    if isinstance(failure, OperationFailed):
                        raise OperationFailed(f"{failure} (replaced {done} of {len(slots)} slots before it)")
                    raise failure
                done += len(batch)
            for r in await asyncio.gather(*exits, return_exceptions=True):
                if isinstance(r, BaseException):
                    raise r
        finally:
            for t in exits:
                if not t.done():
                    t.cancel()  # a failed roll does not wait for the drains it started (they go on)
        return f"replaced {done} slot(s)"
