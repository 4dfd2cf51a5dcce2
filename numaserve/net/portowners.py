"""One port, one owner: find who else already listens where we are about to.

SO_REUSEPORT lets any process of the same user join a port's listener group
and take a share of its connections, silently: a second ``numaserve start``
(or any server) on the same port would answer part of the first one's
traffic.  Before listening, the supervisor lists the namespace's TCP
listeners (``sockdiag``), keeps those whose address overlaps one of its bind
addresses, and names their owning processes (socket inode → ``/proc/*/fd``).

Overlap is what the kernel's listener lookup makes of it: ``0.0.0.0:P`` and
``127.0.0.1:P`` are different groups, but the specific one wins every
connection to 127.0.0.1 — so they overlap; a dual-stack ``[::]:P`` (not
v6-only) takes IPv4 connections too.

``overlaps`` and ``conflicts`` are pure; ``owners`` and ``check_binds`` read
the system.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from numaserve.errors import UsageError
from numaserve.net.listeners import SO_REUSEPORT, BindAddress
from numaserve.net.sockdiag import TcpSocket, listening_sockets

__all__ = ["Owner", "Conflict", "overlaps", "conflicts", "owners", "describe", "check_binds"]

_ANY4, _ANY6 = "0.0.0.0", "::"


@dataclass(frozen=True)
class Owner:
    pid: int
    command: str


@dataclass
class Conflict:
    """Our bind address and a foreign listener that would share its connections."""

    ours: BindAddress
    theirs: TcpSocket
    owners: list[Owner] = field(default_factory=list)


def _mapped_v4(addr: str) -> str | None:
    try:
        ip = ipaddress.IPv6Address(addr)
    except ValueError:
        return None
    return str(ip.ipv4_mapped) if ip.ipv4_mapped is not None else None


def overlaps(ours: BindAddress, theirs: TcpSocket) -> bool:
    """Would ``theirs`` take connections meant for ``ours`` (same port, overlapping address)?

    Our IPv6 listeners are always v6-only.  A foreign IPv6 listener whose
    v6-only flag is unknown (``/proc`` fallback) counts as dual-stack: better
    a refusal with the owner's name than a silent share.
    """
    if theirs.local_port != ours.port:
        return False
    if ours.family == socket.AF_INET:
        if theirs.family == socket.AF_INET:
            return _ANY4 in (ours.host, theirs.local) or theirs.local == ours.host
        if theirs.local == _ANY6:
            return theirs.v6only is not True
        v4 = _mapped_v4(theirs.local)
        return v4 is not None and (_ANY4 in (ours.host, v4) or v4 == ours.host)
    if theirs.family != socket.AF_INET6 or _mapped_v4(theirs.local) is not None:
        return False
    return _ANY6 in (ours.host, theirs.local) or ipaddress.ip_address(theirs.local) == ipaddress.ip_address(ours.host)


def conflicts(binds: Sequence[BindAddress], listeners: Iterable[TcpSocket],
              own_inodes: Iterable[int] = ()) -> list[Conflict]:
    """Foreign listeners overlapping any of ``binds`` (ours, by inode, left out)."""
    mine = set(own_inodes)
    out = []
    socks = list(listeners)
    for b in binds:
        for s in socks:
            if s.inode not in mine and overlaps(b, s):
                out.append(Conflict(b, s))
    return out


def owners(inodes: Iterable[int], *, proc: str = "/proc") -> dict[int, list[Owner]]:
    """Socket inode → the processes holding it open (those whose fds we may read)."""
    want = {f"socket:[{i}]": i for i in inodes if i}
    found: dict[int, list[Owner]] = {}
    if not want:
        return found
    try:
        pids = [int(p) for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return found
    for pid in sorted(pids):
        fd_dir = os.path.join(proc, str(pid), "fd")
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue
        hit: set[int] = set()
        for n in names:
            try:
                target = os.readlink(os.path.join(fd_dir, n))
            except OSError:
                continue
            if target in want:
                hit.add(want[target])
        if hit:
            owner = Owner(pid, _command(pid, proc))
            for i in hit:
                found.setdefault(i, []).append(owner)
    return found


def _command(pid: int, proc: str) -> str:
    try:
        with open(os.path.join(proc, str(pid), "cmdline"), "rb") as f:
            raw = f.read(4096)
    except OSError:
        raw = b""
    cmd = " ".join(p.decode(errors="replace") for p in raw.split(b"\0") if p)
    if not cmd:
        try:
            with open(os.path.join(proc, str(pid), "comm")) as f:
                cmd = f.read().strip()
        except OSError:
            cmd = "?"
    return cmd if len(cmd) <= 80 else cmd[:77] + "..."


def describe(c: Conflict) -> str:
    """``pid 1234 (python3 -m numaserve start ...) listens on 0.0.0.0:8000``."""
    if c.owners:
        who = ", ".join(f"pid {o.pid} ({o.command})" for o in c.owners[:3])
        if len(c.owners) > 3:
            who += f" and {len(c.owners) - 3} more"
    else:
        who = (f"a process of uid {c.theirs.uid} (socket inode {c.theirs.inode}; "
               "its /proc entries are not readable by this user)")
    return f"{who} listens on {c.theirs.address}"


def _test_bind(b: BindAddress) -> None:
    """Bind (never listen) a socket with our listeners' options: the kernel's own verdict.

    EADDRINUSE here means an owner that did not set SO_REUSEPORT or runs as
    another user; EACCES a privileged port; EADDRNOTAVAIL an address this
    machine does not have.  Never listening, it never joins a group.
    """
    s = socket.socket(b.family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, SO_REUSEPORT, 1)
        if b.family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((b.host, b.port))
    finally:
        s.close()


def check_address_is_local(b: BindAddress) -> None:
    """Refuse (UsageError) an address this machine does not have, as ``start`` does, without the port.

    For ``config check``: binding port 0 asks the kernel about the address
    alone, so a config whose port a running supervisor holds still checks.
    """
    try:
        _test_bind(BindAddress(b.text, b.host, 0, b.family))
    except OSError as e:
        hint = " (this machine has no such address)" if e.errno == errno.EADDRNOTAVAIL else ""
        raise UsageError(f"server.bind {b.text}: cannot bind: {e.strerror}{hint}") from None


def check_binds(binds: Sequence[BindAddress], *, takeover: bool = False,
                listeners: Sequence[TcpSocket] | None = None,
                owner_lookup: "Mapping[int, list[Owner]] | None" = None) -> list[str]:
    """Refuse (UsageError, exit 2) a bind address someone else already listens on.

    Returns warnings: with ``takeover`` a foreign listener is reported and
    allowed (a deliberate upgrade: the new instance joins the old one's
    group).  Port 0 (the kernel picks a free port) is never shared.
    """
    for b in binds:
        try:
            _test_bind(b)
        except OSError as e:
            taken = conflicts([b], listeners if listeners is not None else listening_sockets(b.port))
            for c in taken:
                c.owners = (owner_lookup or owners([c.theirs.inode])).get(c.theirs.inode, [])
            if e.errno == errno.EADDRINUSE:
                who = "; ".join(describe(c) for c in taken) or "another socket holds it"
                raise UsageError(f"server.bind {b.text}: address in use: {who} "
                                 "(without SO_REUSEPORT, or as another user, so it cannot be shared)") from None
            hint = {errno.EACCES: " (ports below 1024 need root or CAP_NET_BIND_SERVICE)",
                    errno.EADDRNOTAVAIL: " (this machine has no such address)"}.get(e.errno or 0, "")
            raise UsageError(f"server.bind {b.text}: cannot bind: {e.strerror}{hint}") from None
    fixed = [b for b in binds if b.port != 0]
    if not fixed:
        return []
    if listeners is None:
        listeners = [s for p in sorted({b.port for b in fixed}) for s in listening_sockets(p)]
    found = conflicts(fixed, listeners)
    if not found:
        return []
    table = owner_lookup if owner_lookup is not None else owners(c.theirs.inode for c in found)
    merged: dict[tuple[str, str], Conflict] = {}
    for c in found:  # one line per (our address, their address), every owning process once
        m = merged.setdefault((c.ours.text, c.theirs.address), Conflict(c.ours, c.theirs))
        for o in table.get(c.theirs.inode, []):
            if o not in m.owners:
                m.owners.append(o)
    lines = [f"{c.ours.text}: {describe(c)}" for c in merged.values()]
    if takeover:
        return [f"server.bind {line}: sharing the port (takeover): new connections are split with it "
                "until it stops" for line in lines]
    raise UsageError(
        "server.bind " + "; ".join(lines) + ": a second server on the port would silently take a share of its "
        "connections (SO_REUSEPORT). Stop it, choose another --bind, or pass --takeover to join it on purpose "
        "(e.g. to replace it with this instance)"
    )
