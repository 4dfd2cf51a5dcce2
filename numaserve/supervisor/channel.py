"""The supervisor's end of the worker control channel: transport only.

One ZeroMQ ROUTER socket; every message is decoded here (``on_control_frames``:
never raises, refused ones counted) and goes to a callback
(``WorkerMessages.handle_worker_msg``: the supervisor decides what it means).
Out: commands to one worker or to all, each matched with its Ack by
(command id, slot, generation).  ``sticky`` commands are replayed to every
worker that says Hello later, so a setting with an epoch reaches new workers.

Every send and receive is a direct, non-blocking call on the libzmq socket;
the event loop watches the socket's fd only while this channel wants to be
woken (``serve`` waiting for a message), never during a coalescing pause or
a hold (``hold``): pyzmq's asyncio layer would keep a reader on that fd for
good and wake the loop for every worker whose pipe turned readable.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Mapping, Protocol, Sequence

import structlog
import zmq
import zmq.asyncio

from numaserve.control import messages as m
from numaserve.control.peercred import PeerCred, peer_cred
from numaserve.control.zmqwatch import ReadWatch
from numaserve.control.zmqwatch import wake as _done
from numaserve.supervisor import slots as S

__all__ = ["COALESCE_S", "RECV_BATCH", "WorkerChannel", "WorkerMessages", "frame_bytes", "on_control_frames"]

log = structlog.get_logger("numaserve.supervisor")
#: ``on_control_frames``'s events keep the logger they had in ``controlplane``
control_log = structlog.get_logger("numaserve.ops")

#: Messages taken from the socket per wake-up before yielding to the event loop:
#: a burst (32 Acks of one command, one interval's heartbeats) costs one pass,
#: not 32, and the supervision loop still runs between batches.
RECV_BATCH = 256
#: ``drain`` reads at most this many batches: everything a status or an exit check needs, and a
#: peer flooding the socket still cannot keep the loop from its other work.
DRAIN_BATCHES = 16

#: After a batch, while no command waits for its Acks, the channel lets the
#: socket fill for this long before it reads again: workers beat on a shared
#: grid (``numaserve.worker.control.next_beat_due``), so one interval's beats
#: arrive within a few ms and are read in one or two wake-ups instead of 32.
#: A command sent meanwhile ends the pause at once (``_hurry``), so Acks are
#: never held; Hello/Ready/Goodbye wait at most this long (a start-up, a
#: restart is hundreds of ms).
COALESCE_S = 0.02


class WorkerMessages(Protocol):
    """Where the worker channel hands each decoded message (transport only here)."""

    def count_bad(self, channel: str, why: str) -> None: ...

    def handle_worker_msg(self, identity: bytes, msg: m.WorkerToSupervisor, peer: PeerCred | None = None) -> None: ...


def frame_bytes(f: Any) -> bytes:
    """A received frame's bytes (pyzmq Frame or bytes): the receive paths take either, so they are fuzzed
    without sockets."""
    if isinstance(f, (bytes, bytearray)):
        return bytes(f)
    b = getattr(f, "bytes", None)
    if isinstance(b, bytes):
        return b
    raise TypeError(f"not a frame: {type(f).__name__}")


def on_control_frames(sup: WorkerMessages, frames: Sequence[Any]) -> None:
    """One message from a worker: decode, check, hand to the supervisor.  Never raises."""
    try:
        if len(frames) != 2:
            sup.count_bad("control", f"{len(frames)} frames")
            return
        identity, payload = frame_bytes(frames[0]), frame_bytes(frames[1])
        try:
            msg = m.decode_from_worker(payload)
        except m.BadMessage as e:
            sup.count_bad("control", str(e))
            return
        sup.handle_worker_msg(identity, msg, peer_cred(frames[1]))
    except Exception as e:  # never let one message take the loop down
        control_log.exception("control_handler_error", error=str(e))
        sup.count_bad("control", f"{type(e).__name__}: {e}")


class WorkerChannel:
    def __init__(self, slots: Mapping[int, S.SlotState]) -> None:
        self.slots = slots
        self.sock: zmq.asyncio.Socket | None = None     # bound by the supervisor's open()
        self._acks: dict[tuple[str, int, int], asyncio.Future[m.Ack]] = {}
        # settings every worker must have (cache version, limits ...): replayed to
        # each new worker right after its Hello, so it starts at the current epoch
        self.sticky: dict[str, dict[str, Any]] = {}
        self._sync: zmq.Socket | None = None
        self._sync_of: zmq.asyncio.Socket | None = None
        self.coalesce_s = COALESCE_S
        self._hurry: asyncio.Future[None] | None = None   # set while serve() pauses to coalesce
        self._watch = ReadWatch()   # waiting while serve() watches the fd
        self.held = False         # ``hold``: between passes, wait for a command or ``hold(False)``, not the fd
        self.wakeups = 0          # receive passes (each: one wake-up of the loop for this socket)
        self.received = 0         # messages read

    async def serve(self, handler: WorkerMessages) -> None:
        """Receive worker messages for good: wait until the socket is readable, handle what is queued
        (until EAGAIN, up to a batch), then pause to let the rest of the burst queue up (``COALESCE_S``,
        none while Acks are awaited).

        Only readiness is awaited (``poll``), never a message: every message is taken by a direct read
        and handled at once, here or in ``drain()``, so they are handled in the order a worker sent
        them.  An awaited ``recv`` would hold one message in its future until this task runs again,
        and a ``drain()`` in between would handle the next one first (a worker's Ready before its
        Hello: refused, and the slot waited for the ready timeout).
        """
        assert self.sock is not None
        while True:
            if self.held and not self._acks:
                await self._pause(None)
            try:
                await self._readable()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                log.warning("control_recv_error", error=str(e))
                await asyncio.sleep(0.05)
                continue
            n = self._read_queued(handler)
            if n == 0:   # drain() took them first, the fd signalled something else (POLLOUT), or hold()
                continue
            self.wakeups += 1
            if self._acks or n >= RECV_BATCH:
                await asyncio.sleep(0)
            elif self.held:
                continue
            elif self.coalesce_s > 0:
                await self._pause(self.coalesce_s)
            else:
                await asyncio.sleep(0)

    async def _readable(self) -> None:
        """Until a message is queued (or ``hold`` asks to stop watching): the fd is watched only for this wait
        (``numaserve.control.zmqwatch``)."""
        await self._watch.wait(self._sync_sock())

    def hold(self, on: bool) -> None:
        """``True``: after a pass, leave messages queued until a command expects Acks, ``hold(False)``,
        or the supervisor's tick reads them (``drain``); ``False``: read as they come (coalesced).

        Why: while every slot is settled the tick reads the beats right after each beat
        grid point anyway; without the hold the channel woke the loop several times a second
        for the same beats.  The supervisor holds only while every beat it expects is in.
        """
        if on == self.held:
            return
        self.held = on
        if not on:
            self._hurry_up()
        else:
            self._watch.release()   # stop watching the fd now, not after the next message

    def _read_queued(self, handler: WorkerMessages) -> int:
        """Handle up to a batch of queued messages through the direct socket; how many."""
        sync = self._sync_sock()
        n = 0
        for _ in range(RECV_BATCH):
            try:
                frames = sync.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:   # EAGAIN: queue empty (the next poll re-checks before it waits)
                break
            n += 1
            on_control_frames(handler, frames)
        self.received += n
        return n

    async def _pause(self, seconds: float | None) -> None:
        """Sleep ``seconds`` (None: until woken) unless a command is sent meanwhile (``_hurry_up``)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._hurry = fut
        timer = loop.call_later(seconds, _done, fut) if seconds is not None else None
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()
            self._hurry = None

    def _hurry_up(self) -> None:
        """A command expects Acks: read them as they come, not after the coalescing pause."""
        fut = self._hurry
        if fut is not None:
            _done(fut)

    def _sync_sock(self) -> zmq.Socket:
        """The same libzmq socket without the asyncio layer: every send and receive of this channel.

        The asyncio socket itself is never used for I/O, so pyzmq never puts its own
        (permanent) reader on the fd.
        """
        assert self.sock is not None
        if self._sync is None or self._sync_of is not self.sock:
            self._sync = zmq.Socket.shadow(self.sock.underlying)
            self._sync_of = self.sock
        return self._sync

    def drain(self, handler: WorkerMessages) -> int:
        """Handle every message already queued, now (no wait; 0 when the socket is not bound yet).

        Why: the receive loop pauses up to ``COALESCE_S`` between passes (and, held, until this is
        called), and a worker's last words (a Goodbye naming why its app failed to load) must be read
        before its exit is judged.
        """
        if self.sock is None:
            return 0
        n = 0
        for _ in range(DRAIN_BATCHES):   # a full batch means more may be queued; a flood cannot hold the loop
            got = self._read_queued(handler)
            n += got
            if got < RECV_BATCH:
                break
        if n:
            self._recheck()      # these reads took the fd's edge: a waiting ``serve`` must look again
        return n

    def resolve(self, ack: m.Ack) -> None:
        """An Ack arrived: wake whoever waits for it (late or unknown Acks are dropped)."""
        fut = self._acks.pop((ack.ref, ack.slot, ack.generation), None)
        if fut is not None and not fut.done():
            fut.set_result(ack)

    def send_soon(self, w: S.WorkerProc, msg: m.Msg) -> None:
        """Send now, without waiting (a full or gone peer drops it: Stop/Drain are backed by deadlines)."""
        self._send(w, msg)

    def replay_sticky(self, w: S.WorkerProc) -> None:
        for name, args in self.sticky.items():
            self.send_soon(w, m.Command(id=f"sticky-{name}-{uuid.uuid4().hex[:6]}", name=name, args=args))

    def _send(self, w: S.WorkerProc, msg: m.Msg) -> bool:
        """One message to one worker, non-blocking, in call order (no task per message)."""
        if w.identity is None or self.sock is None:
            return False
        try:
            self._sync_sock().send_multipart([w.identity, m.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        self._recheck()
        return True

    def _recheck(self) -> None:
        """A send (or a read outside ``serve``) processes libzmq's pending commands, and with them the
        fd's edge for messages that came meanwhile: a waiting ``serve`` must look again."""
        self._watch.recheck(self._sync_sock())

    async def broadcast_one(self, w: S.WorkerProc, name: str, args: dict[str, Any], *,
                            timeout: float = 5.0) -> dict[str, Any]:
        """Send one named command to one worker and wait for its Ack."""
        slot = next(s for s in self.slots.values() if any(x is w for x in s.workers()))
        cid = uuid.uuid4().hex[:12]
        fut: asyncio.Future[m.Ack] = asyncio.get_running_loop().create_future()
        self._acks[(cid, slot.plan.slot, w.generation)] = fut
        self._hurry_up()
        self._send(w, m.Command(id=cid, name=name, args=args))
        try:
            ack = await asyncio.wait_for(fut, timeout)
            return {"ok": ack.ok, "detail": ack.detail}
        except asyncio.TimeoutError:
            return {"ok": False, "detail": f"no ack within {timeout:g}s"}
        finally:
            self._acks.pop((cid, slot.plan.slot, w.generation), None)

    def send_command(self, w: S.WorkerProc, name: str, args: dict[str, Any]) -> None:
        """Fire-and-forget named command to one worker (its Ack is logged)."""
        if w.identity is None or w.external or w.popen.poll() is not None:
            return
        self._send(w, m.Command(id=f"{name}-{uuid.uuid4().hex[:8]}", name=name, args=args))

    async def command_each(self, targets: Sequence[tuple[int, S.WorkerProc, dict[str, Any]]], name: str, *,
                           timeout: float = 5.0) -> list[dict[str, Any]]:
        """``Command(name, args)`` to each (slot, worker, args) at once; every Ack awaited together.

        One command id, all sends done without yielding, then one wait: the
        fan-out to 32 workers costs one pass of the loop, not 32 tasks with a
        timer each.  Returns per target, in order: ok, detail (a worker that
        does not answer within ``timeout`` is reported, not waited for).
        """
        cid = uuid.uuid4().hex[:12]
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[m.Ack] | None] = []
        sync = self._sync_sock() if self.sock is not None else None
        for slot, w, args in targets:
            if w.identity is None or sync is None:
                futs.append(None)
                continue
            fut: asyncio.Future[m.Ack] = loop.create_future()
            key = (cid, slot, w.generation)
            self._acks[key] = fut
            try:
                sync.send_multipart([w.identity, m.encode(m.Command(id=cid, name=name, args=args))], zmq.NOBLOCK)
            except zmq.ZMQError:
                self._acks.pop(key, None)
                fut = None  # type: ignore[assignment]
            futs.append(fut)
        if sync is not None:
            self._recheck()
        pending = [f for f in futs if f is not None]
        if pending:
            self._hurry_up()
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        out: list[dict[str, Any]] = []
        for (slot, w, _), fut in zip(targets, futs):
            self._acks.pop((cid, slot, w.generation), None)
            if fut is None:
                out.append({"ok": False, "detail": "not sent: the worker has no control connection"})
            elif fut.done() and not fut.cancelled():
                ack = fut.result()
                out.append({"ok": ack.ok, "detail": ack.detail})
            else:
                fut.cancel()
                out.append({"ok": False, "detail": f"no ack within {timeout:g}s"})
        return out

    async def broadcast(self, name: str, args: dict[str, Any], *, timeout: float = 5.0,
                        sticky: bool = False) -> dict[str, Any]:
        """Send ``Command(name, args)`` to every live worker and wait for each Ack.

        ``sticky``: remember it so workers started later get it too (settings
        with an epoch). Returns per slot: pid, generation, ok, detail; a worker
        that does not answer within ``timeout`` is reported, not waited for.
        """
        if sticky:
            self.sticky[name] = dict(args)
        targets: list[tuple[int, S.WorkerProc, dict[str, Any]]] = []
        keys: list[str] = []
        for slot in self.slots.values():
            for w in (slot.worker, slot.incoming):
                if w is None or w.identity is None or w.external or w.popen.poll() is not None:
                    continue
                targets.append((slot.plan.slot, w, args))
                keys.append(str(slot.plan.slot) if w is slot.worker else f"{slot.plan.slot}/incoming")
        results = await self.command_each(targets, name, timeout=timeout)
        return {key: {"pid": w.pid, "generation": w.generation, **res}
                for key, (_, w, _), res in zip(keys, targets, results)}

