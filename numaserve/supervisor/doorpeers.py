"""Who is really behind an ops request that came through a front door.

A front door (``frontdoor``) splices each client connection to libzmq over
a unix connection the supervisor itself makes, so libzmq's ``Peer-Address``
names the supervisor for every one of them: the rate limit then fell back to
one bucket per connection, and one member of ``ops.readonly_group`` with 16
connections got 16 budgets.  The door knows the client (SO_PEERCRED of the
accepted unix socket), so it binds its side of each spliced connection to
a unique abstract unix name and records name -> client here.  For a
message, libzmq tells which fd it was read from (``ZMQ_SRCFD``); the fd's
peer name is the door's abstract name, and so the client's credentials.
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import Any

import zmq

from numaserve.control.peercred import PeerCred

__all__ = ["DoorPeers", "unix_cred"]


def unix_cred(sock: socket.socket | None) -> PeerCred | None:
    """SO_PEERCRED of a connected unix socket (None for TCP or when the kernel says nothing)."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
    except OSError:
        return None
    pid, uid, gid = (int.from_bytes(raw[i:i + 4], "little", signed=True) for i in (0, 4, 8))
    if pid <= 0 or uid < 0 or gid < 0:
        return None
    return PeerCred(uid=uid, gid=gid, pid=pid)


class DoorPeers:
    """Abstract socket name of a spliced connection -> the credentials of the client behind it."""

    def __init__(self) -> None:
        self._prefix = f"\0numaserve-door-{os.getpid()}-{secrets.token_hex(6)}-"
        self._next = 0
        self._peers: dict[bytes, PeerCred] = {}

    def new_name(self) -> str:
        """A fresh abstract name for the door's side of one spliced connection."""
        self._next += 1
        return f"{self._prefix}{self._next}"

    def register(self, name: str, cred: PeerCred) -> None:
        self._peers[name.encode()] = cred

    def forget(self, name: str) -> None:
        self._peers.pop(name.encode(), None)

    def __len__(self) -> int:
        return len(self._peers)

    def of_frame(self, frame: Any) -> PeerCred | None:
        """The client behind the connection ``frame`` was read from (None: not one of ours, or unknown)."""
        if not self._peers:
            return None
        try:
            fd = frame.get(zmq.SRCFD)
        except Exception:   # bytes (no properties), or a libzmq without ZMQ_SRCFD
            return None
        if not isinstance(fd, int) or fd < 0:
            return None
        try:
            s = socket.socket(fileno=fd)   # no dup: detached below, so libzmq's fd is never closed here
        except OSError:
            return None
        try:
            name = s.getpeername() if s.family == socket.AF_UNIX else None
        except OSError:
            name = None
        finally:
            s.detach()
        return self._peers.get(name) if isinstance(name, bytes) else None
