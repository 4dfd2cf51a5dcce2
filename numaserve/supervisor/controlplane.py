"""The supervisor's ZeroMQ control plane: socket options, and the receive paths.

Every socket the supervisor binds gets (``bind_socket``):

* ``ZMQ_MAXMSGSIZE`` -- also on the event stream's PUB, which receives
  subscription frames: libzmq stores each subscription prefix in a trie of
  about 100 bytes per prefix byte, so one 20 MB subscription frame cost a
  2 GB RSS without it.  Many small distinct subscriptions grow the trie
  too (XPUB_MANUAL does not help: it keeps its own trie of them), so the
  stream also sits behind a front door that closes a subscriber once it
  has sent more than a few KB (``EVENTS_CLIENT_BYTES``); closing the
  connection frees its subscriptions.
* ``ZMQ_HANDSHAKE_IVL``: a connection that has not finished the ZMTP (and
  CURVE) handshake within a few seconds is closed.
* ``LINGER 0``, and ``SNDHWM`` bounded on the stream (a slow subscriber
  loses events rather than growing the supervisor).

The receive paths never raise and never starve the supervision loop: one
message, then a yield to the event loop; ops requests are rate-limited per
peer; malformed or refused messages are counted in ``bad_messages``.
``on_ops_frames``/``on_control_frames`` take frames (pyzmq Frames or bytes)
so they are fuzzed without sockets.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, AsyncIterator, Protocol, Sequence

import msgspec
import structlog
import zmq
import zmq.asyncio

from numaserve.control import messages as m
from numaserve.control.peercred import PeerCred, frame_property, peer_cred
from numaserve.supervisor.curvekeys import AuthorizedKeys
from numaserve.supervisor.opsapi import OpsTarget
from numaserve.supervisor.ratelimit import PeerRateLimiter

__all__ = [
    "EVENTS_CLIENT_BYTES",
    "HANDSHAKE_IVL_MS",
    "MAX_OPS_BYTES",
    "bind_socket",
    "on_control_frames",
    "on_ops_frames",
    "serve_control",
    "serve_ops",
    "verified_who",
]

log = structlog.get_logger("numaserve.ops")


class OpsServer(OpsTarget, Protocol):
    """What serving the ops sockets needs beyond the verbs: key check, rate limit, the bad-message count."""

    curve_keys: AuthorizedKeys | None
    ops_limiter: PeerRateLimiter

    def count_bad(self, channel: str, why: str) -> None: ...


class WorkerMessages(Protocol):
    """Where the worker channel hands each decoded message (transport only here)."""

    def count_bad(self, channel: str, why: str) -> None: ...

    def handle_worker_msg(self, identity: bytes, msg: m.WorkerToSupervisor, peer: PeerCred | None = None) -> None: ...

MAX_OPS_BYTES = 64 * 1024
HANDSHAKE_IVL_MS = 5000
MAX_SUBSCRIPTION_BYTES = 256   # a subscription frame: 1 flag byte + a topic prefix ("event", "stats")
EVENTS_SNDHWM = 100
EVENTS_CLIENT_BYTES = 4096     # what one subscriber may send in all: greeting + a few subscriptions
_CLAIMED_KEYS = 8
_CLAIMED_TEXT = 200


def _frame_bytes(f: Any) -> bytes:
    if isinstance(f, (bytes, bytearray)):
        return bytes(f)
    b = getattr(f, "bytes", None)
    if isinstance(b, bytes):
        return b
    raise TypeError(f"not a frame: {type(f).__name__}")


def bind_socket(ctx: zmq.asyncio.Context, kind: int, endpoint: str, **opts: Any) -> zmq.asyncio.Socket:
    """Create and bind one supervisor socket with the bounds above."""
    sock = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        if kind in (zmq.PUB, zmq.XPUB):
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_SUBSCRIPTION_BYTES)
            sock.setsockopt(zmq.SNDHWM, EVENTS_SNDHWM)
        else:
            sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_MESSAGE_BYTES)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        for name, value in opts.items():
            setattr(sock, name, value)
        sock.bind(endpoint)
    except BaseException:
        sock.close(0)
        raise
    return sock


# ------------------------------------------------------------------------ ops


def _claimed(who: Any) -> dict[str, Any]:
    """What the client says about itself, kept small and scalar (it is only a claim)."""
    out: dict[str, Any] = {}
    if not isinstance(who, dict):
        return out
    for k, v in list(who.items())[:_CLAIMED_KEYS]:
        if not isinstance(k, str):
            continue
        if isinstance(v, str):
            out[k[:64]] = v[:_CLAIMED_TEXT]
        elif isinstance(v, (bool, int)) or v is None:
            out[k[:64]] = v
    return out


def verified_who(claimed: Any, peer: PeerCred | None, curve_key: str | None) -> dict[str, Any]:
    """The audit's ``who``: what the kernel or CURVE proved first, the client's own claim under ``claimed``."""
    who: dict[str, Any] = {"claimed": _claimed(claimed)}
    if curve_key:
        who.update(curve_key=curve_key, verified_by="CURVE")
    elif peer is not None and peer.pid != os.getpid():
        who.update(peer.to_json(), verified_by="SO_PEERCRED")
    else:
        who["verified_by"] = None
    return who


def _rate_key(channel: str, identity: bytes, peer: PeerCred | None, curve_key: str | None) -> tuple[Any, ...]:
    if curve_key:
        return (channel, "key", curve_key)
    if peer is not None and peer.pid != os.getpid():
        return (channel, "pid", peer.uid, peer.pid)
    return (channel, "id", identity)   # behind a front door: one routing id per (capped) connection


def _encode_reply(reply: m.OpsReply) -> bytes:
    try:
        return msgspec.msgpack.encode(reply)
    except (TypeError, ValueError, OverflowError) as e:
        log.error("ops_reply_unencodable", error=str(e))
        return msgspec.msgpack.encode(m.OpsReply(ok=False, id=reply.id, error=f"reply not encodable: {e}"))


async def on_ops_frames(sup: OpsServer, frames: Sequence[Any], channel: str, *,
                        readonly: bool = False) -> list[bytes] | None:
    """One ops request → the reply frames (None: nothing to reply to).  Never raises."""
    from numaserve.supervisor.ops import MUTATING, handle_ops_request

    try:
        if not frames:
            sup.count_bad("ops", "empty message")
            return None
        identity = _frame_bytes(frames[0])
        last = frames[-1]
        payload = _frame_bytes(last)
        # REQ clients send [identity, b"", payload]; DEALER clients [identity, payload]
        envelope = [identity, b""] if len(frames) == 3 and _frame_bytes(frames[1]) == b"" else [identity]
        if len(frames) not in (2, 3) or len(payload) > MAX_OPS_BYTES:
            sup.count_bad("ops", f"{len(frames)} frames / {len(payload)} bytes")
            return envelope + [_encode_reply(m.OpsReply(ok=False, error="malformed request"))]
        curve_key = frame_property(last, "User-Id") if channel == "tcp-curve" else None
        peer = None if channel == "tcp-curve" else peer_cred(last)
        if channel == "tcp-curve" and not (curve_key and sup.curve_keys is not None
                                           and sup.curve_keys.callback("*", curve_key.encode())):
            # ZAP judged the connection when it was made; the key may have been removed since
            sup.count_bad("ops", "CURVE key not (or no longer) authorized")
            return envelope + [_encode_reply(m.OpsReply(ok=False, error="this CURVE key is not authorized"))]
        allowed, retry = sup.ops_limiter.allow(_rate_key(channel, identity, peer, curve_key))
        if not allowed:
            return envelope + [_encode_reply(m.OpsReply(
                ok=False, error=f"rate limited: more than {sup.ops_limiter.rate:g} requests/s from this client "
                                f"(burst {sup.ops_limiter.burst:g}); retry in {retry:.2f}s"))]
        try:
            req = m.decode_ops_request(payload)
        except m.BadMessage as e:
            sup.count_bad("ops", str(e))
            return envelope + [_encode_reply(m.OpsReply(ok=False, error=f"malformed request: {e}"))]
        who = verified_who(req.who, peer, curve_key)
        reply = await handle_ops_request(sup, req, channel=channel, readonly=readonly, who=who)
        if isinstance(req.verb, str) and req.verb in MUTATING:
            sup.wake.set()
        return envelope + [_encode_reply(reply)]
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a bug here must not end the ops loop
        log.exception("ops_frames_error", channel=channel)
        sup.count_bad("ops", f"{type(e).__name__}: {e}")
        return None


async def _messages(sock: zmq.asyncio.Socket, what: str) -> AsyncIterator[list[Any]]:
    """Messages from ``sock`` (Frames, for their properties), one per iteration; errors logged, never raised.

    The caller yields to the event loop after each: a done future does not,
    so without it queued messages would run back to back and the supervision
    loop, /healthz and reaping would wait for the queue to empty.
    """
    while True:
        try:
            yield await sock.recv_multipart(copy=False)
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as e:
            log.warning(f"{what}_recv_error", error=str(e))
            await asyncio.sleep(0.05)


async def serve_ops(sup: OpsServer, sock: zmq.asyncio.Socket, channel: str, *, readonly: bool = False) -> None:
    """Serve one ops socket, one request at a time, yielding between requests."""
    async for frames in _messages(sock, "ops"):
        out = await on_ops_frames(sup, frames, channel, readonly=readonly)
        if out:
            try:
                await sock.send_multipart(out, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        await asyncio.sleep(0)


# -------------------------------------------------------------------- control


def on_control_frames(sup: WorkerMessages, frames: Sequence[Any]) -> None:
    """One message from a worker: decode, check, hand to the supervisor.  Never raises."""
    try:
        if len(frames) != 2:
            sup.count_bad("control", f"{len(frames)} frames")
            return
        identity, payload = _frame_bytes(frames[0]), _frame_bytes(frames[1])
        try:
            msg = m.decode_from_worker(payload)
        except m.BadMessage as e:
            sup.count_bad("control", str(e))
            return
        sup.handle_worker_msg(identity, msg, peer_cred(frames[1]))
    except Exception as e:  # never let one message take the loop down
        log.exception("control_handler_error", error=str(e))
        sup.count_bad("control", f"{type(e).__name__}: {e}")


async def serve_control(sup: WorkerMessages, sock: zmq.asyncio.Socket) -> None:
    async for frames in _messages(sock, "control"):
        on_control_frames(sup, frames)
        await asyncio.sleep(0)
