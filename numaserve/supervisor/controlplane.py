"""The supervisor's ZeroMQ control plane: socket options, and the ops receive path.

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

The ops receive path never raises and never starves the supervision loop:
one message, then a yield to the event loop; requests are rate-limited per
peer; malformed or refused ones are counted in ``bad_messages``.
``on_ops_frames`` takes frames (pyzmq Frames or bytes) so it is fuzzed
without sockets.  The worker channel's receive path is ``channel.on_control_frames``.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol, Sequence

import msgspec
import structlog
import zmq
import zmq.asyncio

from numaserve.control import messages as m
from numaserve.control.peercred import PeerCred, frame_property, peer_cred
from numaserve.supervisor.channel import frame_bytes
from numaserve.supervisor.curvekeys import AuthorizedKeys
from numaserve.supervisor import opsflight
from numaserve.supervisor.doorpeers import DoorPeers
from numaserve.supervisor.opsapi import OpsTarget
from numaserve.supervisor.opsflight import InFlight, stale_by
from numaserve.supervisor.ratelimit import PeerRateLimiter

__all__ = [
    "EVENTS_CLIENT_BYTES",
    "Admitted",
    "Answer",
    "admit",
    "execute",
    "HANDSHAKE_IVL_MS",
    "MAX_OPS_BYTES",
    "bind_socket",
    "on_ops_frames",
    "serve_ops",
    "verified_who",
]

log = structlog.get_logger("numaserve.ops")


class OpsGate(Protocol):
    """What serving the ops sockets needs beyond the verbs (``opsplane.OpsPlane``): key check, rate limit,
    the bad-message count."""

    curve_keys: AuthorizedKeys | None
    ops_limiter: PeerRateLimiter
    door_peers: DoorPeers

    def count_bad(self, channel: str, why: str) -> None: ...


MAX_OPS_BYTES = 64 * 1024
HANDSHAKE_IVL_MS = 5000
MAX_SUBSCRIPTION_BYTES = 256   # a subscription frame: 1 flag byte + a topic prefix ("event", "stats")
EVENTS_SNDHWM = 100
EVENTS_CLIENT_BYTES = 4096     # what one subscriber may send in all: greeting + a few subscriptions
_CLAIMED_KEYS = 8
RATE_LIMITED_DELAY_MIN = 0.25   # a rate-limited reply waits at least this long (and at most the next)
RATE_LIMITED_DELAY_MAX = 2.0
STATUS_TTL = 0.5                # the read-only socket's status is at most this old
DELAYED_MAX = 1024              # rate-limited replies waiting on one socket; past that answered at once
_CLAIMED_TEXT = 200


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


def _rate_key(channel: str, identity: bytes, peer: PeerCred | None, curve_key: str | None,
              door_peer: PeerCred | None = None) -> tuple[Any, ...]:
    """Whose budget a request spends.

    CURVE: the key.  Through a front door (the read-only socket): the client's
    uid as the kernel says -- processes and connections are free to multiply,
    a uid is not.  The owner's socket (0700: the service's own user and root):
    uid and pid, so an operator's fresh CLI is not locked out by a runaway
    script of the same user, who could stop the service anyway.
    """
    if curve_key:
        return (channel, "key", curve_key)
    if door_peer is not None:
        return (channel, "uid", door_peer.uid)
    if peer is not None and peer.pid != os.getpid():
        return (channel, "pid", peer.uid, peer.pid)
    return (channel, "id", identity)   # behind a front door we cannot see through: one id per connection


def _encode_reply(reply: m.OpsReply) -> bytes:
    try:
        return msgspec.msgpack.encode(reply)
    except (TypeError, ValueError, OverflowError) as e:
        log.error("ops_reply_unencodable", error=str(e))
        return msgspec.msgpack.encode(m.OpsReply(ok=False, id=reply.id, error=f"reply not encodable: {e}"))


@dataclass
class Answer:
    """A reply decided without running a verb: sent after ``delay`` s (a rate-limited peer waits its turn)."""

    frames: list[bytes]
    delay: float = 0.0


@dataclass
class Admitted:
    """A request that passed the checks and the rate limit: run it (``execute``) in its own task."""

    envelope: list[bytes]
    req: m.OpsRequest
    who: dict[str, Any]
    key: tuple[Any, ...]


def admit(sup: OpsGate, frames: Sequence[Any], channel: str) -> Admitted | Answer | None:
    """Check one request (framing, CURVE key, rate limit, decoding) without running it.  Never raises.

    None: nothing to reply to.  Cheap on purpose: a flood is answered here.
    """
    try:
        if not frames:
            sup.count_bad("ops", "empty message")
            return None
        identity = frame_bytes(frames[0])
        last = frames[-1]
        payload = frame_bytes(last)
        # REQ clients send [identity, b"", payload]; DEALER clients [identity, payload]
        envelope = [identity, b""] if len(frames) == 3 and frame_bytes(frames[1]) == b"" else [identity]
        if len(frames) not in (2, 3) or len(payload) > MAX_OPS_BYTES:
            sup.count_bad("ops", f"{len(frames)} frames / {len(payload)} bytes")
            return Answer(envelope + [_encode_reply(m.OpsReply(ok=False, error="malformed request"))])
        curve_key = frame_property(last, "User-Id") if channel == "tcp-curve" else None
        peer = None if channel == "tcp-curve" else peer_cred(last)
        if channel == "tcp-curve" and not (curve_key and sup.curve_keys is not None
                                           and sup.curve_keys.callback("*", curve_key.encode())):
            # ZAP judged the connection when it was made; the key may have been removed since
            sup.count_bad("ops", "CURVE key not (or no longer) authorized")
            return Answer(envelope + [_encode_reply(m.OpsReply(ok=False, error="this CURVE key is not authorized"))])
        door_peer = sup.door_peers.of_frame(last) if peer is not None and peer.pid == os.getpid() else None
        key = _rate_key(channel, identity, peer, curve_key, door_peer)
        allowed, retry = sup.ops_limiter.allow(key)
        if not allowed:
            # answered after the wait it names: a client looping on replies then costs a reply per wait
            return Answer(envelope + [_encode_reply(m.OpsReply(
                ok=False, error=f"rate limited: more than {sup.ops_limiter.rate:g} requests/s from this client "
                                f"(burst {sup.ops_limiter.burst:g}); retry in {retry:.2f}s"))],
                delay=min(RATE_LIMITED_DELAY_MAX, max(RATE_LIMITED_DELAY_MIN, retry)))
        try:
            req = m.decode_ops_request(payload)
        except m.BadMessage as e:
            sup.count_bad("ops", str(e))
            return Answer(envelope + [_encode_reply(m.OpsReply(ok=False, error=f"malformed request: {e}"))])
        return Admitted(envelope, req, verified_who(req.who, door_peer or peer, curve_key), key)
    except Exception as e:  # a bug here must not end the ops loop
        log.exception("ops_frames_error", channel=channel)
        sup.count_bad("ops", f"{type(e).__name__}: {e}")
        return None


class StatusCache:
    """The read-only socket's ``status``, assembled at most every ``ttl`` s.

    Assembling a status (every slot, front door, counter) is the cost of a
    read-only flood; a reader of the group-readable socket gets a snapshot
    at most ``ttl`` old.  The owner's socket always assembles it fresh.
    """

    def __init__(self, ttl: float = STATUS_TTL) -> None:
        self.ttl = ttl
        self._at = -1e18
        self._value: Any = None

    def get(self, sup: OpsTarget) -> Any:
        now = time.monotonic()
        if now - self._at >= self.ttl:
            self._value, self._at = sup.status(), now
        return self._value


async def execute(sup: OpsTarget, gate: OpsGate, adm: Admitted, channel: str, *, readonly: bool = False,
                  status_cache: StatusCache | None = None) -> list[bytes] | None:
    """Run an admitted request -> its reply frames.  Never raises (but is cancellable).

    A request read after its client's own deadline is not executed (local
    sockets, where both ends share the clock): its client has given up, and
    a ``stop`` nobody waits for any more must not happen later.
    """
    from numaserve.supervisor.ops import MUTATING, handle_ops_request

    req = adm.req
    try:
        late = stale_by(req.timeout, req.sent_at, opsflight.wall()) if channel != "tcp-curve" else None
        if late is not None:
            log.warning("ops_request_expired", verb=req.verb, id=req.id, late_s=round(late, 3), channel=channel)
            return adm.envelope + [_encode_reply(m.OpsReply(
                ok=False, id=req.id, error=f"not executed: read {late:.1f}s after the client's {req.timeout:g}s "
                                           "timeout had passed (the client was no longer waiting)"))]
        if status_cache is not None and req.verb == "status" and isinstance(req.args, dict):
            return adm.envelope + [_encode_reply(m.OpsReply(ok=True, id=req.id, result=status_cache.get(sup)))]
        reply = await handle_ops_request(sup, req, channel=channel, readonly=readonly, who=adm.who)
        if isinstance(req.verb, str) and req.verb in MUTATING:
            sup.table.wake.set()
        return adm.envelope + [_encode_reply(reply)]
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a bug here must not end the ops loop
        log.exception("ops_frames_error", channel=channel)
        gate.count_bad("ops", f"{type(e).__name__}: {e}")
        return None


async def on_ops_frames(sup: OpsTarget, gate: OpsGate, frames: Sequence[Any], channel: str, *,
                        readonly: bool = False) -> list[bytes] | None:
    """One ops request → the reply frames (None: nothing to reply to), no delay.  Never raises."""
    got = admit(gate, frames, channel)
    if got is None or isinstance(got, Answer):
        return None if got is None else got.frames
    return await execute(sup, gate, got, channel, readonly=readonly)


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


def _send(sock: zmq.asyncio.Socket, out: list[bytes] | None) -> None:
    """Send without waiting (a reply the peer cannot take now is dropped, as ROUTER does)."""
    if not out:
        return
    try:
        fut = sock.send_multipart(out, flags=zmq.NOBLOCK)
    except zmq.ZMQError:
        return
    if isinstance(fut, asyncio.Future):   # the asyncio socket reports EAGAIN on the future: read it
        fut.add_done_callback(lambda f: None if f.cancelled() else f.exception())


async def serve_ops(sup: OpsTarget, gate: OpsGate, sock: zmq.asyncio.Socket, channel: str, *,
                    readonly: bool = False, inflight: InFlight | None = None) -> None:
    """Serve one ops socket: every admitted request in its own task (bounded by ``InFlight``).

    Checks and refusals are answered from this loop; rate-limited replies go
    out after their delay (at most ``DELAYED_MAX`` waiting, then at once).
    """
    flight = inflight if inflight is not None else InFlight()
    cache = StatusCache() if readonly else None
    loop = asyncio.get_running_loop()
    delayed: set[asyncio.TimerHandle] = set()

    def later(delay: float, out: list[bytes]) -> None:
        def fire() -> None:
            delayed.discard(handle)
            _send(sock, out)
        handle = loop.call_later(delay, fire)
        delayed.add(handle)

    async def run(adm: Admitted) -> None:
        _send(sock, await execute(sup, gate, adm, channel, readonly=readonly, status_cache=cache))

    try:
        async for frames in _messages(sock, "ops"):
            got = admit(gate, frames, channel)
            if isinstance(got, Answer):
                if got.delay > 0 and len(delayed) < DELAYED_MAX:
                    later(got.delay, got.frames)
                else:
                    _send(sock, got.frames)
            elif isinstance(got, Admitted):
                why = flight.refusal(got.key)
                if why is not None:
                    _send(sock, got.envelope + [_encode_reply(m.OpsReply(ok=False, id=got.req.id, error=why))])
                else:
                    flight.start(got.key, run(got), name=f"ops-{channel}")
            await asyncio.sleep(0)
    finally:
        for h in delayed:
            h.cancel()
        await flight.cancel_all()
