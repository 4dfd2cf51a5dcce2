"""A bounded front door for the ZeroMQ ops sockets that less trusted peers can reach.

libzmq has no per-listener connection limit, and a connection it accepted
holds a supervisor fd until the peer goes away; a flood of idle TCP
connections to ``ops.tcp_endpoint`` (no key needed to connect) or of ipc
connections to the group-readable ``ops-ro.sock`` therefore fills the fd
table, and then libzmq aborts the supervisor (see ``fdbudget``).  So these
two listeners are ours: asyncio accepts, enforces a cap and an idle
timeout, and splices each connection's bytes to the libzmq socket bound on a
private ipc path in the 0700 runtime directory.  ZMTP (and CURVE) run end to
end between the client and libzmq, unchanged; the supervisor only moves
bytes.

At the cap the oldest connection that has been quiet for a second is closed
to make room (an idle flood cannot lock an operator out); when every
connection is busy the new one is closed at once.  A connection that stays
quiet for ``idle_timeout`` is closed; one that never completes the ZMTP or
CURVE handshake is closed by libzmq (``ZMQ_HANDSHAKE_IVL``), and then here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import time
from collections import OrderedDict
from typing import Any

import structlog

from numaserve.errors import NumaserveError
from numaserve.supervisor.doorpeers import DoorPeers, unix_cred

__all__ = ["FrontDoor", "bind_tcp", "bind_unix", "listen_tcp", "parse_tcp_endpoint"]

log = structlog.get_logger("numaserve.ops")

_HIGH_WATER = 256 * 1024     # bytes buffered toward one side before the other side is paused
_PENDING_MAX = 64 * 1024     # bytes a client may send before the backend connection is up
_QUIET_FOR_EVICTION = 1.0    # a connection quiet this long may be closed to admit a new one
_WARN_EVERY = 10.0
ACCEPT_BATCH = 8

#: Ops clients at once per door (each also costs a backend socket and libzmq's side: 3 fds) and the
#: seconds an ops connection may stay idle: operators and scripts, not a crowd.
OPS_MAX_CONNECTIONS = 16
OPS_IDLE_TIMEOUT = 30.0


def parse_tcp_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` (HOST ``*`` = every address, ``[v6]`` for IPv6) → (host, port)."""
    from numaserve.config import parse_bind

    if not endpoint.startswith("tcp://"):
        raise ValueError("expected tcp://HOST:PORT")
    rest = endpoint[len("tcp://"):]
    if rest.startswith("*:"):
        rest = "0.0.0.0" + rest[1:]
    return parse_bind(rest)


def listen_tcp(host: str, port: int, backlog: int) -> socket.socket:
    """A non-blocking TCP listener (IPv6: v6 only); raises OSError / socket.gaierror."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def bind_tcp(endpoint: str, backlog: int = 64) -> socket.socket:
    """Bind and listen on ``endpoint`` before any worker exists (NumaserveError names the key)."""
    try:
        host, port = parse_tcp_endpoint(endpoint)
        return listen_tcp(host, port, backlog)
    except (ValueError, socket.gaierror) as e:
        raise NumaserveError(f"ops.tcp_endpoint {endpoint}: {e}") from None
    except OSError as e:
        raise NumaserveError(f"ops.tcp_endpoint {endpoint}: cannot bind: {e.strerror}") from None


def bind_unix(path: str, backlog: int = 64) -> socket.socket:
    """Bind a unix stream listener at ``path`` (call under the runtime dir's tight umask)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise NumaserveError(f"{path}: cannot listen: {e.strerror}") from None
    return sock


def _peer_of(sock: socket.socket | None) -> str:
    """Who connected: ``ip:port`` for TCP, ``uid=U pid=P`` (SO_PEERCRED) for unix sockets."""
    if sock is None:
        return "?"
    try:
        if sock.family == socket.AF_UNIX:
            pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                 struct.calcsize("3i")))
            return f"uid={uid} gid={gid} pid={pid}"
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"


class _Side(asyncio.Protocol):
    """One half of a spliced connection (the client's or the backend's)."""

    def __init__(self, conn: "_Conn", is_client: bool) -> None:
        self.conn = conn
        self.is_client = is_client
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.is_client:
            self.conn.client_made(transport)
        else:
            self.conn.backend_made(transport)

    def data_received(self, data: bytes) -> None:
        self.conn.forward(data, from_client=self.is_client)

    def eof_received(self) -> bool | None:
        self.conn.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.lost(self.is_client)

    def pause_writing(self) -> None:   # our buffer toward this side is full: stop reading the other
        other = self.conn.backend if self.is_client else self.conn.client
        if other is not None and not other.is_closing():
            other.pause_reading()

    def resume_writing(self) -> None:
        other = self.conn.backend if self.is_client else self.conn.client
        if other is not None and not other.is_closing():
            other.resume_reading()


class _Conn:
    """A client connection and its spliced backend connection."""

    def __init__(self, door: "FrontDoor") -> None:
        self.door = door
        self.client: asyncio.Transport | None = None
        self.backend: asyncio.Transport | None = None
        self.pending: list[bytes] = []
        self.pending_bytes = 0
        self.opened = self.last = time.monotonic()
        self.peer = "?"
        self.sent = 0          # bytes from the client
        self.closed = False
        self.admitted = False
        self.bound_name: str | None = None   # the backend side's abstract name, registered in door.peers

    def busy(self, now: float) -> bool:
        return now - self.last < _QUIET_FOR_EVICTION

    def client_made(self, transport: asyncio.Transport) -> None:
        self.client = transport
        self.peer = _peer_of(transport.get_extra_info("socket"))
        if not self.door.admit(self):
            self.closed = True
            transport.abort()  # refused: closed at once, no fd kept
            return
        self.admitted = True
        self.door.connect_backend(self)

    def backend_made(self, transport: asyncio.Transport) -> None:
        if self.closed:
            transport.abort()
            return
        self.backend = transport
        for chunk in self.pending:
            transport.write(chunk)
        self.pending.clear()
        self.pending_bytes = 0

    def forward(self, data: bytes, *, from_client: bool) -> None:
        if self.closed:
            return
        self.last = time.monotonic()
        if from_client:
            self.sent += len(data)
            limit = self.door.max_client_bytes
            if limit is not None and self.sent > limit:
                self.door.over_budget += 1
                self.door.warn(self.last, f"closed a client that sent more than {limit} bytes", self.peer)
                self.close()
                return
            if self.backend is None:
                self.pending.append(data)
                self.pending_bytes += len(data)
                if self.pending_bytes > _PENDING_MAX:
                    self.close()
                return
            self.backend.write(data)
        elif self.client is not None:
            self.client.write(data)

    def lost(self, client_side: bool) -> None:
        if client_side:
            self.client = None
        else:
            self.backend = None
        self.close()

    def close(self) -> None:
        self.closed = True
        for t in (self.client, self.backend):
            if t is not None and not t.is_closing():
                t.close()
        self.door.forget(self)


class FrontDoor:
    """A capped, idle-timed listener spliced to a libzmq socket on ``backend_path``."""

    def __init__(self, name: str, sock: socket.socket, backend_path: str, *, max_connections: int,
                 idle_timeout: float | None, max_client_bytes: int | None = None,
                 peers: DoorPeers | None = None) -> None:
        self.name = name
        self.peers = peers   # unix clients: who is behind each spliced connection (for the ops rate limit)
        self.sock = sock
        self.backend_path = backend_path
        self.max_connections = max(1, int(max_connections))
        self.idle_timeout = idle_timeout
        self.max_client_bytes = max_client_bytes   # what one client may send in all (None: no limit)
        self.over_budget = 0
        self.conns: OrderedDict[int, _Conn] = OrderedDict()   # oldest first
        self.accepted = self.refused = self.evicted = self.idle_closed = self.backend_failed = 0
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._last_warn = 0.0
        self._closed = False
        self.address = self._address()

    def _address(self) -> str:
        try:
            name = self.sock.getsockname()
        except OSError:
            return "?"
        if isinstance(name, str):
            return name
        host, port = name[:2]
        return f"[{host}]:{port}" if self.sock.family == socket.AF_INET6 else f"{host}:{port}"

    # -- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        factory = lambda: _Side(_Conn(self), True)  # noqa: E731
        # backlog: also how many connections asyncio accepts per readiness event, before
        # admit() runs; the fd budget counts one batch per listener
        if self.sock.family == socket.AF_UNIX:
            self._server = await loop.create_unix_server(factory, sock=self.sock, backlog=ACCEPT_BATCH)
        else:
            self._server = await loop.create_server(factory, sock=self.sock, backlog=ACCEPT_BATCH)
        if self.idle_timeout is not None:
            self._sweeper = loop.create_task(self._sweep(), name=f"frontdoor-{self.name}")

    async def stop(self) -> None:
        sweeper = self._sweeper
        self.close()
        if sweeper is not None:
            with contextlib.suppress(BaseException):
                await sweeper

    def close(self) -> None:
        """Stop listening and close every connection (idempotent; also before ``start``)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._server is not None:
            self._server.close()
            self._server = None
        self.close_all()
        if not self._closed:
            self._closed = True
            self.sock.close()   # asyncio's server.close() may have closed it already
            if self.sock.family == socket.AF_UNIX:
                with contextlib.suppress(OSError):
                    os.unlink(self.address)

    def close_all(self) -> int:
        """Close every connection now (clients reconnect: e.g. re-authenticate after a key change)."""
        conns = list(self.conns.values())
        for c in conns:
            c.close()
        self.conns.clear()
        return len(conns)

    # -- admission ------------------------------------------------------------
    def admit(self, conn: _Conn) -> bool:
        now = time.monotonic()
        if len(self.conns) >= self.max_connections:
            victim = next((c for c in self.conns.values() if not c.busy(now)), None)
            if victim is None:
                self.refused += 1
                self.warn(now, "refused", conn.peer)
                return False
            self.evicted += 1
            self.warn(now, "evicted an idle connection", victim.peer)
            self.conns.pop(id(victim), None)
            victim.close()
        self.accepted += 1
        self.conns[id(conn)] = conn
        log.debug("ops_connection", door=self.name, peer=conn.peer, connections=len(self.conns))
        return True

    def warn(self, now: float, what: str, peer: str) -> None:
        if now - self._last_warn >= _WARN_EVERY:
            self._last_warn = now
            log.warning("ops_connections_full", door=self.name, address=self.address, action=what, peer=peer,
                        max_connections=self.max_connections, refused=self.refused, evicted=self.evicted)

    def connect_backend(self, conn: _Conn) -> None:
        async def connect() -> None:
            loop = asyncio.get_running_loop()
            cred = unix_cred(conn.client.get_extra_info("socket")) if conn.client is not None else None
            try:
                if self.peers is None or cred is None:
                    await loop.create_unix_connection(lambda: _Side(conn, False), self.backend_path)
                    return
                # bound to a name of ours: the supervisor finds the client behind a message by it
                name = self.peers.new_name()
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.setblocking(False)
                    sock.bind(name)
                    await loop.sock_connect(sock, self.backend_path)
                except BaseException:
                    sock.close()
                    raise
                if conn.closed:
                    sock.close()
                    return
                conn.bound_name = name
                self.peers.register(name, cred)
                try:
                    await loop.create_unix_connection(lambda: _Side(conn, False), sock=sock)
                except BaseException:
                    sock.close()
                    raise
            except OSError as e:
                self.backend_failed += 1
                log.warning("ops_backend_unreachable", door=self.name, backend=self.backend_path, error=e.strerror)
                conn.close()

        asyncio.get_running_loop().create_task(connect())

    def forget(self, conn: _Conn) -> None:
        self.conns.pop(id(conn), None)
        if conn.bound_name is not None and self.peers is not None:
            self.peers.forget(conn.bound_name)
            conn.bound_name = None

    async def _sweep(self) -> None:
        while self.idle_timeout is not None:
            idle = self.idle_timeout
            await asyncio.sleep(min(1.0, max(0.05, idle / 4)))
            now = time.monotonic()
            for c in [c for c in self.conns.values() if now - c.last > idle]:
                self.idle_closed += 1
                c.close()

    def status(self) -> dict[str, Any]:
        return {"address": self.address, "connections": len(self.conns), "max_connections": self.max_connections,
                "idle_timeout_s": self.idle_timeout, "accepted": self.accepted, "refused": self.refused,
                "evicted_idle": self.evicted, "closed_idle": self.idle_closed, "closed_over_budget": self.over_budget}
