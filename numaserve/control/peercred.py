"""Who is on the other end of a ZeroMQ ipc connection, as the kernel says.

libzmq reads ``SO_PEERCRED`` when it accepts an ipc connection and appends
``:uid:gid:pid`` to the connection's ``Peer-Address`` message property
(``stream_engine_base.cpp``; Linux, libzmq >= 4.2), e.g.
``"localhost:1000:1000:4242"``.  The pid is the process that called
``connect()``, fixed at connect time: a message cannot lie about it.  pyzmq
exposes the property on frames received with ``copy=False``
(``frame.get("Peer-Address")``).  TCP peers carry just an address, so
``peer_cred`` returns None for them (and on platforms without SO_PEERCRED):
callers then rely on the other checks (the spawn token, CURVE keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PeerCred", "frame_property", "parse_peer_address", "peer_cred"]


@dataclass(frozen=True)
class PeerCred:
    """Kernel-verified credentials of an ipc peer."""

    uid: int
    gid: int
    pid: int

    def to_json(self) -> dict[str, int]:
        return {"uid": self.uid, "gid": self.gid, "pid": self.pid}


def parse_peer_address(text: str | None) -> PeerCred | None:
    """``"localhost:UID:GID:PID"`` → PeerCred; anything else (TCP, unknown) → None."""
    if not text:
        return None
    parts = text.rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        uid, gid, pid = (int(p) for p in parts[1:])
    except ValueError:
        return None
    if min(uid, gid, pid) < 0 or pid == 0:
        return None
    return PeerCred(uid=uid, gid=gid, pid=pid)


def frame_property(frame: Any, name: str) -> str | None:
    """A message property of a pyzmq Frame (None for bytes, or when libzmq has none)."""
    get = getattr(frame, "get", None)
    if get is None:
        return None
    try:
        value = get(name)
    except Exception:  # zmq.ZMQError (EINVAL: no such property), KeyError on old pyzmq
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def peer_cred(frame: Any) -> PeerCred | None:
    """Verified credentials of the sender of ``frame`` (ipc only)."""
    return parse_peer_address(frame_property(frame, "Peer-Address"))
