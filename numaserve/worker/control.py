"""The worker's side of the control channel: a ZeroMQ DEALER and a command dispatcher.

The channel is created inside the running event loop, i.e. after the
launcher bound CPU and memory, so libzmq's I/O thread inherits the binding
(FACTS §1.6).  Sends never block the loop: they are ``DONTWAIT`` and a full
queue drops the message (counted) — a stuck supervisor must not stall
serving; heartbeats are periodic anyway.  Every send and receive is a direct
call on the libzmq socket; the loop watches the socket's fd only while
``recv`` waits (pyzmq's asyncio layer would add a future, a task step and a
reader that fires for every send's completion to each Command the worker
answers: with 32 workers on 2 CPUs that is most of a fan-out's time).

The dispatcher is separate and transport-free so it is unit-tested with a
fake ``post``.  Malformed frames are counted and dropped, never fatal.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import math
from typing import Any, Callable, Protocol

import zmq

from numaserve.control.messages import (
    Ack,
    BadMessage,
    Command,
    Drain,
    Msg,
    Stop,
    decode_from_supervisor,
    encode,
)
from numaserve.control.zmqwatch import ReadWatch

__all__ = [
    "BEAT_PHASE_STEP_S",
    "CommandDispatcher",
    "ControlChannel",
    "WorkerActions",
    "beat_phase",
    "next_beat_due",
    "worker_identity",
]

#: Heartbeat phase per slot (``beat_phase``): 32 slots spread over 3.2 ms, so the
#: workers of one interval do not all wake on the same tick of the clock (2 CPUs
#: would run them one after another anyway) and the supervisor still reads the
#: whole interval's beats in one wake-up (its coalescing window is longer).
BEAT_PHASE_STEP_S = 0.0001
_BEAT_PHASE_SLOTS = 64
#: Of an interval: the shortest gap after a late beat, so it is back on the grid within two
#: beats (the supervisor reads on-grid beats once per grid point, and reads as they come
#: while any is off it: ``numaserve.supervisor.arbiter.Supervisor._beats_in``).
_MIN_BEAT_GAP = 0.5


def beat_phase(slot: int) -> float:
    """Offset of this slot's beats from the interval grid, seconds (small: see ``BEAT_PHASE_STEP_S``)."""
    return (slot % _BEAT_PHASE_SLOTS) * BEAT_PHASE_STEP_S


def next_beat_due(now: float, interval: float, phase: float = 0.0) -> float:
    """When the beat after one sent at ``now`` is due: the next point of the grid
    ``k * interval + phase`` (CLOCK_MONOTONIC), but never less than half and never
    more than 1 interval away.

    Every process on the host reads the same monotonic clock, so workers that
    beat on the grid send one interval's beats within a few milliseconds of
    each other and the supervisor drains them in one wake-up instead of one
    wake-up per worker spread over the second.  A beat that came late (a
    blocked loop) is not followed by a second one at once: the next comes at
    least half an interval later, and the one after that is on the grid again
    (at most two beats off it, so the supervisor's once-per-grid-point reads
    are suspended only briefly).  Never more than one
    interval, so hang detection (``unresponsive_after`` > one interval) reads
    silence exactly as before.
    """
    if not (interval > 0.0 and math.isfinite(interval)):
        raise ValueError(f"heartbeat interval must be a positive number of seconds, got {interval!r}")
    gap = interval - (now - phase) % interval
    return now + max(gap, _MIN_BEAT_GAP * interval)


def worker_identity(slot: int, generation: int, pid: int) -> bytes:
    """ROUTER identity of a worker: ``b"slot:generation:pid"``.

    Only a name: the supervisor trusts a worker for its spawn token and its
    kernel-reported pid (``numaserve.control.workerauth``), not for this.
    """
    return f"{slot}:{generation}:{pid}".encode()


class ControlChannel:
    """A DEALER connected to the supervisor's worker ROUTER.

    Frames from the supervisor are ``[payload]`` (a ROUTER strips the identity);
    a leading empty delimiter frame is tolerated.  The last frame is the message.
    """

    def __init__(self, endpoint: str, identity: bytes, *, linger_ms: int = 500,
                 sndhwm: int = 1000) -> None:
        self.endpoint = endpoint
        self.identity = identity
        self.linger_ms = linger_ms
        self.dropped = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, identity)
        self._sock.setsockopt(zmq.LINGER, linger_ms)
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        self._sock.setsockopt(zmq.RCVHWM, 1000)
        self._sock.connect(endpoint)
        self._closed = False
        self._watch = ReadWatch()   # waiting while recv() watches the fd

    def post(self, msg: Msg) -> bool:
        """Queue ``msg`` without blocking; False (and counted) if it was dropped."""
        if self._closed:
            self.dropped += 1
            return False
        try:
            self._sock.send(encode(msg), zmq.DONTWAIT)
        except zmq.ZMQError:   # EAGAIN: the queue to the supervisor is full
            self.dropped += 1
            return False
        self._recheck()
        return True

    def _recheck(self) -> None:
        """A send processes libzmq's pending commands, and with them the fd's edge for a message that
        came meanwhile: a waiting ``recv`` must look again, or that message waits for the next one."""
        self._watch.recheck(self._sock)

    async def recv(self) -> bytes:
        """Next message payload (last frame): read at once when one is queued, else after the fd says so."""
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
                return frames[-1] if frames else b""
            except zmq.Again:
                pass
            await self._readable()

    async def _readable(self) -> None:
        """Until a message may be queued (``numaserve.control.zmqwatch``: the fd is watched only meanwhile)."""
        await self._watch.wait(self._sock)

    def close(self, linger_ms: int | None = None) -> None:
        """Close, letting queued messages (e.g. Goodbye) flush for up to ``linger_ms``."""
        if self._closed:
            return
        self._closed = True
        linger = self.linger_ms if linger_ms is None else linger_ms
        self._sock.close(linger=linger)
        self._ctx.term()


class WorkerActions(Protocol):
    """What the dispatcher asks of the worker."""

    def request_stop(self, deadline: float, reason: str) -> None: ...

    def request_drain(self, deadline: float) -> None: ...

    def set_limits(self, args: dict[str, Any]) -> tuple[bool, str]: ...


def _malloc_trim() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _cache_command(cache: Any, name: str, args: dict[str, Any]) -> tuple[bool, str]:
    """``cache_purge {prefix}`` / ``cache_version {version}`` on the worker's response cache."""
    if name == "cache_purge":
        prefix = args.get("prefix", "")
        if not isinstance(prefix, str):
            return False, "prefix must be a string"
        if cache is None:
            return True, "cache disabled: nothing to purge"
        n = cache.purge(prefix)
        return True, f"purged {n} entries" + (f" under {prefix}" if prefix else "") + f" (version {cache.version})"
    version = args.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        return False, f"version must be an integer >= 0, got {version!r}"
    if cache is None:
        return True, f"cache disabled: version {version} noted"
    if version < cache.version:
        return True, f"version {version} is older than {cache.version}: kept"
    dropped = cache.set_version(version)
    return True, f"version {version}: dropped {dropped} entries"


class CommandDispatcher:
    """Turns supervisor frames into worker actions and ``Ack`` replies.

    Stop/Drain are acknowledged on receipt (the supervisor learns the command
    arrived; completion is the later ``Goodbye`` and exit status).
    """

    def __init__(self, slot: int, generation: int, actions: WorkerActions,
                 post: Callable[[Msg], object],
                 log_debug: Callable[..., object] | None = None) -> None:
        self.slot = slot
        self.generation = generation
        self.actions = actions
        self.post = post
        self.bad_frames = 0
        self._debug = log_debug or (lambda *a, **k: None)

    def _ack(self, ref: str, ok: bool = True, detail: str = "") -> None:
        self.post(Ack(slot=self.slot, generation=self.generation, ref=ref, ok=ok, detail=detail))

    def handle_frame(self, frame: bytes) -> None:
        """Decode and dispatch one frame; bad frames are counted and dropped."""
        try:
            msg = decode_from_supervisor(frame)
        except BadMessage as e:
            self.bad_frames += 1
            self._debug("control_bad_frame", error=str(e)[:200], size=len(frame),
                        bad_frames=self.bad_frames)
            return
        self.handle(msg)

    def handle(self, msg: Msg) -> None:
        if isinstance(msg, Stop):
            self._ack(msg.id)
            self.actions.request_stop(max(0.0, msg.deadline), "stopped")
        elif isinstance(msg, Drain):
            self.actions.request_drain(max(0.0, msg.deadline))
            self._ack(msg.id)
        elif isinstance(msg, Command):
            self._command(msg)
        else:  # a type the decoder accepts but we do not handle
            self.bad_frames += 1
            self._debug("control_unhandled", type=type(msg).__name__)

    def _command(self, cmd: Command) -> None:
        if cmd.name == "ping":
            self._ack(cmd.id)
        elif cmd.name == "set_limits":
            ok, detail = self.actions.set_limits(cmd.args)
            self._ack(cmd.id, ok=ok, detail=detail)
        elif cmd.name in ("cache_purge", "cache_version"):
            ok, detail = _cache_command(getattr(self.actions, "cache", None), cmd.name, cmd.args)
            self._ack(cmd.id, ok=ok, detail=detail)
        elif cmd.name == "trim":
            collected = gc.collect()
            trimmed = _malloc_trim()
            self._ack(cmd.id, detail=f"gc collected {collected}; malloc_trim {'released' if trimmed else 'nothing'}")
        else:
            self._ack(cmd.id, ok=False, detail=f"unknown command {cmd.name}")
