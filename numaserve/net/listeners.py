"""Supervisor-owned SO_REUSEPORT listeners: one socket per worker slot.

The supervisor creates every slot's socket before any worker exists, in slot
order (TCP sockets join the reuseport group at ``listen()``, so slot order is
group order), and keeps its reference for its whole life.  A worker gets a
duplicate through fd inheritance; when it crashes or is replaced only the
duplicate closes, the socket stays in the group and its accept queue keeps
every waiting connection for the next worker (FACTS §7.1, §7.8).

A ``unix:PATH`` bind is one socket shared by every slot (``ListenerSet.shared``,
numaserve.net.unixbind): AF_UNIX has no reuseport groups to steer.
"""

from __future__ import annotations

import errno
import re
import socket
from dataclasses import dataclass, field
from typing import Iterable

from numaserve.config import parse_bind
from numaserve.errors import NumaserveError, UsageError
from numaserve.net.unixbind import make_unix_listener, remove_unix_socket
from numaserve.unixaddr import is_unix_bind, unix_path

SO_REUSEPORT = getattr(socket, "SO_REUSEPORT", 15)


@dataclass
class Listener:
    slot: int
    host: str
    port: int
    family: int
    sock: socket.socket
    ino: int = 0          # AF_UNIX: the socket file's inode (removed at close only while it is ours)

    @property
    def fd(self) -> int:
        return self.sock.fileno()

    @property
    def address(self) -> str:
        if self.family == socket.AF_UNIX:
            return f"unix:{self.host}"
        return f"[{self.host}]:{self.port}" if self.family == socket.AF_INET6 else f"{self.host}:{self.port}"


@dataclass
class ListenerSet:
    """All listeners: ``by_slot[slot]`` lists one TCP socket per TCP bind address (its
    reuseport group's member for the slot; empty with unix binds only); ``shared`` the
    unix sockets every slot accepts from."""

    by_slot: dict[int, list[Listener]] = field(default_factory=dict)
    shared: list[Listener] = field(default_factory=list)

    def for_slot(self, slot: int) -> list[Listener]:
        """What a slot's worker inherits and serves: its TCP sockets, then the shared unix ones."""
        return [*self.by_slot.get(slot, []), *self.shared]

    def fds(self, slot: int) -> list[int]:
        return [lst.fd for lst in self.for_slot(slot)]

    def all(self) -> list[Listener]:
        return [lst for ls in self.by_slot.values() for lst in ls] + list(self.shared)

    def addresses(self) -> list[str]:
        seen: list[str] = []
        for lst in self.all():
            if lst.address not in seen:
                seen.append(lst.address)
        return seen

    def urls(self, tls: bool = False) -> list[str]:
        """Each address as an operator types it: ``http://HOST:PORT`` (https with TLS), ``unix:PATH``."""
        scheme = "https" if tls else "http"
        return [a if a.startswith("unix:") else f"{scheme}://{a}" for a in self.addresses()]

    def inodes(self) -> set[int]:
        """Socket inodes of every listener (to tell ours from others' in socket tables)."""
        import os

        out = set()
        for lst in self.all():
            try:
                out.add(os.fstat(lst.fd).st_ino)
            except OSError:
                continue
        return out

    def close(self) -> None:
        """Close every socket; unix socket files are removed (while still ours)."""
        for lst in self.all():
            if lst.family == socket.AF_UNIX and lst.sock.fileno() >= 0:
                remove_unix_socket(lst.host, lst.ino)
            try:
                lst.sock.close()
            except OSError:
                pass
        self.by_slot.clear()
        self.shared.clear()


@dataclass(frozen=True)
class BindAddress:
    """One ``server.bind`` entry, resolved: the numeric address actually bound."""

    text: str      # as configured, for messages
    host: str      # numeric address (no brackets)
    port: int
    family: int

    @property
    def address(self) -> str:
        if self.family == socket.AF_UNIX:
            return f"unix:{self.host}"
        return f"[{self.host}]:{self.port}" if self.family == socket.AF_INET6 else f"{self.host}:{self.port}"


_DOTTED = re.compile(r"^[0-9.]+$")


def resolve_bind(text: str) -> BindAddress:
    """``HOST:PORT`` → the address to bind; UsageError (exit 2) naming what is wrong.

    Runs before anything starts, so ``--bind 300.1.1.1:80`` is a usage error,
    not a half-started supervisor.  ``unix:PATH`` resolves to an AF_UNIX address (host = path).
    """
    if is_unix_bind(text):
        try:
            return BindAddress(text, unix_path(text), 0, socket.AF_UNIX)
        except ValueError as e:
            raise UsageError(f"server.bind {text!r}: {e}") from None
    try:
        host, port = parse_bind(text)
    except ValueError as e:
        raise UsageError(f"server.bind {text!r}: {e}") from None
    if _DOTTED.match(host) and host.count(".") != 3:  # inet_aton would read "1.2.3" as 1.2.0.3
        raise UsageError(f"server.bind {text!r}: {host} is not a valid IPv4 address "
                         "(four numbers 0-255 separated by dots)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        if _DOTTED.match(host):
            raise UsageError(f"server.bind {text!r}: {host} is not a valid IPv4 address "
                             "(four numbers 0-255 separated by dots)") from None
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            why = getattr(e, "strerror", None) or str(e)
            raise UsageError(f"server.bind {text!r}: cannot resolve host {host!r}: {why}") from None
    fam, _, _, _, sockaddr = infos[0]
    if fam not in (socket.AF_INET, socket.AF_INET6):
        raise UsageError(f"server.bind {text!r}: not an IPv4 or IPv6 address")
    return BindAddress(text, str(sockaddr[0]), port, fam)


def resolve_binds(binds: Iterable[str]) -> list[BindAddress]:
    """Every bind entry resolved; the same address twice is refused (it would put
    two sockets per slot in one group and break the slot = group position rule)."""
    out: list[BindAddress] = []
    for text in binds:
        b = resolve_bind(text)
        same = next((o for o in out if (o.family, o.host, o.port) == (b.family, b.host, b.port)
                     and (b.port or b.family == socket.AF_UNIX)), None)
        if same is not None:
            raise UsageError(f"server.bind: {b.text!r} and {same.text!r} are the same address ({b.address})")
        out.append(b)
    return out


def _family(host: str) -> int:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise NumaserveError(f"bind {host}: cannot resolve: {e.strerror}") from None
    return infos[0][0]


def make_listener(host: str, port: int, backlog: int) -> socket.socket:
    """One TCP listener with SO_REUSEPORT (identical options on every slot).

    Non-blocking: the open file description is shared with every worker that
    inherits it (event-driven servers set this themselves anyway), and the
    supervisor must be able to take stranded connections off a dead slot's
    queue without ever blocking its loop.
    """
    fam = _family(host)
    sock = socket.socket(fam, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_REUSEPORT, 1)
        if fam == socket.AF_INET6:
            # [::] and 0.0.0.0 are separate listeners (separate bind entries)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        hint = ""
        if e.errno == errno.EADDRINUSE:
            hint = " (another process without SO_REUSEPORT, or of another user, holds the port)"
        elif e.errno == errno.EACCES:
            hint = " (ports below 1024 need root or CAP_NET_BIND_SERVICE)"
        elif e.errno == errno.EADDRNOTAVAIL:
            hint = " (no such local address)"
        raise NumaserveError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    return sock


def open_listeners(binds: list[str] | list[BindAddress], slots: list[int], backlog: int, *,
                   unix_mode: int = 0o660, unix_gid: int | None = None) -> ListenerSet:
    """Create every slot's listeners, in slot order, for every bind address.

    Port 0 picks one free port for the first slot and reuses it for the rest,
    so all slots share one port (tests rely on this).  A unix bind is one
    socket for all slots (``shared``), with ``unix_mode`` and group ``unix_gid``.
    """
    out = ListenerSet()
    for slot in slots:
        out.by_slot[slot] = []
    try:
        for bind in binds:
            b = bind if isinstance(bind, BindAddress) else resolve_bind(bind)
            host, port, fam = b.host, b.port, b.family
            if fam == socket.AF_UNIX:
                sock, ino = make_unix_listener(host, backlog, unix_mode, unix_gid)
                out.shared.append(Listener(-1, host, 0, fam, sock, ino))
                continue
            for slot in slots:
                sock = make_listener(host, port, backlog)
                if port == 0:
                    port = sock.getsockname()[1]
                out.by_slot.setdefault(slot, []).append(Listener(slot, host, port, fam, sock))
    except BaseException:
        out.close()
        raise
    return out


def accept_queue_depth(sock: socket.socket) -> int | None:
    """Connections waiting in a listener's accept queue (TCP_INFO tcpi_unacked).

    For a listening socket the kernel reports the current accept-queue length
    in ``tcpi_unacked`` (and the backlog in ``tcpi_sacked``).
    """
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except OSError:
        return None
    if len(info) < 32:
        return None
    import struct

    # struct tcp_info: 8 u8 fields, then u32 rto, ato, snd_mss, rcv_mss, unacked, sacked, ...
    unacked = struct.unpack_from("I", info, 8 + 4 * 4)[0]
    return int(unacked)
