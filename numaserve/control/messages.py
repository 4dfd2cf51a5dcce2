"""Typed, versioned control messages (msgpack on the wire).

Every message is a msgspec Struct tagged with its class name, so a receiver
decodes any of them with one ``decode`` call.  ``PROTOCOL`` is carried in
``Hello``; a peer speaking another major version is refused, not guessed at.
Malformed or unknown frames raise ``BadMessage``: callers count and drop them.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

PROTOCOL = 1
MAX_MESSAGE_BYTES = 1 << 20


class BadMessage(ValueError):
    """A frame that is not a valid control message (reason in the text)."""


class Msg(msgspec.Struct, tag=True, kw_only=True, omit_defaults=False):
    pass


# --- worker -> supervisor ------------------------------------------------------


class Placement(msgspec.Struct, kw_only=True):
    """What a worker observed about its own binding, from inside."""

    cpus: list[int]
    mempolicy: str  # numa_maps style token: "bind=static:1", "prefer:0", "default", ...
    ok: bool
    problems: list[str] = []


class Hello(Msg, kw_only=True):
    protocol: int = PROTOCOL
    slot: int
    generation: int
    pid: int
    placement: Placement | None = None
    #: The per-spawn secret the supervisor handed this process (an inherited
    #: pipe, read and closed before the app is imported): proves the sender
    #: is the process that was spawned for this slot/generation.
    token: str = ""


class Ready(Msg, kw_only=True):
    slot: int
    generation: int


class Stats(Msg, kw_only=True):
    slot: int
    generation: int
    requests: int           # completed requests since start (all outcomes)
    inflight: int
    queued: int = 0
    shed: int = 0
    connections: int = 0
    status_classes: dict[str, int] = {}   # "2xx" -> count
    latency_ms: dict[str, float] = {}     # "p50", "p90", "p99", "mean"
    rss_bytes: int = 0
    draining: bool = False
    limits_epoch: int = 0
    extra: dict[str, Any] = {}


class Heartbeat(Msg, kw_only=True):
    """The worker's event loop is alive; with ``stats`` when they are due.

    Carrying the stats on the beat makes one message per worker per interval
    instead of two (the supervisor's idle cost grows with messages).  A
    standalone ``Stats`` is still accepted (and sent when stats are due more
    often than beats).  ``stats`` must name the beat's own slot/generation.
    """

    slot: int
    generation: int
    loop_lag: float  # seconds the event loop was late for this beat
    mono: float      # worker's time.monotonic() when sent
    stats: Stats | None = None


class Ack(Msg, kw_only=True):
    slot: int
    generation: int
    ref: str          # command id or epoch being acknowledged
    ok: bool = True
    detail: str = ""


class Goodbye(Msg, kw_only=True):
    slot: int
    generation: int
    reason: str


# --- supervisor -> worker ------------------------------------------------------


class Stop(Msg, kw_only=True):
    id: str
    deadline: float   # seconds from receipt to finish in-flight work


class Drain(Msg, kw_only=True):
    id: str
    deadline: float


class Command(Msg, kw_only=True):
    """A generic named command (e.g. "trim", "cache_purge") with arguments."""

    id: str
    name: str
    args: dict[str, Any] = {}


WorkerToSupervisor = Union[Hello, Ready, Heartbeat, Stats, Ack, Goodbye]
SupervisorToWorker = Union[Stop, Drain, Command]

_enc = msgspec.msgpack.Encoder()
_dec_w2s = msgspec.msgpack.Decoder(WorkerToSupervisor)
_dec_s2w = msgspec.msgpack.Decoder(SupervisorToWorker)


def encode(msg: Msg) -> bytes:
    return _enc.encode(msg)


def _decode(dec: msgspec.msgpack.Decoder, data: Any) -> Any:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BadMessage(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BadMessage(str(e)[:300]) from None
    except (RecursionError, MemoryError, ValueError, TypeError, OverflowError) as e:
        # deeply nested or absurdly sized input: never a crash of the receiver
        raise BadMessage(f"undecodable: {type(e).__name__}") from None


def decode_from_worker(data: bytes) -> WorkerToSupervisor:
    return _decode(_dec_w2s, data)


def decode_from_supervisor(data: bytes) -> SupervisorToWorker:
    return _decode(_dec_s2w, data)


# --- ops CLI <-> supervisor (request/reply) ------------------------------------


class OpsRequest(msgspec.Struct, kw_only=True):
    verb: str
    args: dict[str, Any] = {}
    id: str = ""
    who: dict[str, Any] = {}   # self-reported by the client (uid, user, pid, host); audited
    # how long the client waits for the reply, from ``sent_at`` (its wall clock); 0 = not said.  A local
    # supervisor that reads the request after that does not execute it: nobody is waiting for the answer
    timeout: float = 0.0
    sent_at: float = 0.0


class OpsReply(msgspec.Struct, kw_only=True):
    ok: bool
    id: str = ""
    result: Any = None
    error: str = ""


_dec_req = msgspec.msgpack.Decoder(OpsRequest)
_dec_rep = msgspec.msgpack.Decoder(OpsReply)


def decode_ops_request(data: bytes) -> OpsRequest:
    return _decode(_dec_req, data)


def decode_ops_reply(data: bytes) -> OpsReply:
    return _decode(_dec_rep, data)
