"""TCP socket tables of this network namespace: who listens where, and one
connection's server side.

Two sources, same answer:

* ``sock_diag`` netlink (``NETLINK_SOCK_DIAG``, ``inet_diag_req_v2``; what
  ``ss`` uses): no privilege needed, filtered by state in the kernel, and it
  tells whether an IPv6 listener is v6-only (``INET_DIAG_SKV6ONLY``), which
  decides whether ``[::]:P`` also takes IPv4 connections to port P.
* ``/proc/net/tcp`` and ``/proc/net/tcp6`` when netlink is unavailable
  (v6-only unknown there).

Parsing is pure (``parse_diag_messages``, ``parse_proc_net_tcp``) and tested
on captured bytes/text; the I/O shells are ``listening_sockets`` and
``find_connection``.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from typing import Iterable, Iterator

__all__ = [
    "TcpSocket",
    "TCP_LISTEN",
    "TCP_ESTABLISHED",
    "listening_sockets",
    "find_connection",
    "parse_diag_messages",
    "parse_proc_net_tcp",
    "socket_inodes_of",
]

TCP_ESTABLISHED = 1
TCP_LISTEN = 10

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
INET_DIAG_SKV6ONLY = 11
INET_DIAG_NOCOOKIE = 0xFFFFFFFF

_NLMSGHDR = struct.Struct("=IHHII")            # len, type, flags, seq, pid
_SOCKID = struct.Struct(">HH16s16sI8s")        # sport, dport (be16), src, dst, ifindex, cookie
_REQ = struct.Struct("=BBBBI")                 # family, protocol, ext, pad, states
_MSG_HEAD = struct.Struct("=BBBB")             # family, state, timer, retrans
_MSG_TAIL = struct.Struct("=IIIII")            # expires, rqueue, wqueue, uid, inode


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket as the kernel lists it (addresses as text, no brackets)."""

    family: int
    state: int
    local: str
    local_port: int
    remote: str
    remote_port: int
    uid: int
    inode: int                 # 0 while a connection waits in an accept queue (no file yet)
    v6only: bool | None = None  # IPv6 listeners; None when the source cannot tell
    rqueue: int = 0            # LISTEN: accept-queue length; else bytes not yet read

    @property
    def address(self) -> str:
        return f"[{self.local}]:{self.local_port}" if self.family == socket.AF_INET6 else \
            f"{self.local}:{self.local_port}"


def _addr_text(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[:4])
    return str(ipaddress.IPv6Address(raw[:16]))


def _addr_bytes(family: int, text: str) -> bytes:
    packed = socket.inet_pton(family, text)
    return packed.ljust(16, b"\0")


# ------------------------------------------------------------------ netlink


def _request(family: int, states: int, *, seq: int, sockid: bytes | None = None) -> bytes:
    flags = NLM_F_REQUEST | (0 if sockid is not None else NLM_F_DUMP)
    sid = sockid if sockid is not None else _SOCKID.pack(0, 0, b"\0" * 16, b"\0" * 16, 0,
                                                        struct.pack("=II", INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
    body = _REQ.pack(family, socket.IPPROTO_TCP, 0, 0, states) + sid
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, flags, seq, 0) + body


def parse_diag_messages(data: bytes) -> tuple[list[TcpSocket], bool, int]:
    """Parse one netlink read: (sockets, done?, errno of an NLMSG_ERROR or 0)."""
    out: list[TcpSocket] = []
    off = 0
    while off + _NLMSGHDR.size <= len(data):
        length, mtype, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data, off)
        if length < _NLMSGHDR.size or off + length > len(data):
            break
        body = data[off + _NLMSGHDR.size: off + length]
        off += (length + 3) & ~3
        if mtype == NLMSG_DONE:
            return out, True, 0
        if mtype == NLMSG_ERROR:
            err = -struct.unpack_from("=i", body, 0)[0] if len(body) >= 4 else 0
            return out, True, err
        if mtype != SOCK_DIAG_BY_FAMILY:
            continue
        need = _MSG_HEAD.size + _SOCKID.size + _MSG_TAIL.size
        if len(body) < need:
            continue
        fam, state, _timer, _retrans = _MSG_HEAD.unpack_from(body, 0)
        sport, dport, src, dst, _if, _cookie = _SOCKID.unpack_from(body, _MSG_HEAD.size)
        _exp, rq, _wq, uid, inode = _MSG_TAIL.unpack_from(body, _MSG_HEAD.size + _SOCKID.size)
        v6only: bool | None = None
        a = need
        while a + 4 <= len(body):
            alen, atype = struct.unpack_from("=HH", body, a)
            if alen < 4:
                break
            if atype == INET_DIAG_SKV6ONLY and alen >= 5:
                v6only = bool(body[a + 4])
            a += (alen + 3) & ~3
        if fam == socket.AF_INET6 and v6only is None:
            v6only = False  # the kernel always sends it for AF_INET6; absent means an old kernel
        out.append(TcpSocket(fam, state, _addr_text(fam, src), sport, _addr_text(fam, dst), dport, uid, inode,
                             v6only if fam == socket.AF_INET6 else None, rq))
    return out, False, 0


def _netlink(requests: Iterable[bytes]) -> list[TcpSocket]:
    """Send each request; a dump reads until NLMSG_DONE, an exact lookup reads one answer."""
    out: list[TcpSocket] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(2.0)
        for req in requests:
            dump = bool(struct.unpack_from("=H", req, 6)[0] & NLM_F_DUMP)
            nl.send(req)
            while True:
                got, done, err = parse_diag_messages(nl.recv(1 << 16))
                out.extend(got)
                if err and err != errno.ENOENT:  # ENOENT: an exact lookup found nothing
                    raise OSError(err, os.strerror(err))
                if done or (not dump and got):
                    break
    return out


# ----------------------------------------------------------------- /proc/net


def _proc_addr(family: int, text: str) -> tuple[str, int]:
    hexaddr, hexport = text.split(":")
    raw = bytes.fromhex(hexaddr)
    # the kernel prints each 32-bit word in host byte order
    words = [raw[i:i + 4][::-1] if struct.pack("=I", 1) == b"\x01\0\0\0" else raw[i:i + 4]
             for i in range(0, len(raw), 4)]
    return _addr_text(family, b"".join(words)), int(hexport, 16)


def parse_proc_net_tcp(text: str, family: int) -> list[TcpSocket]:
    """``/proc/net/tcp`` (``family`` AF_INET) or ``tcp6`` (AF_INET6) → sockets."""
    out: list[TcpSocket] = []
    for line in text.splitlines()[1:]:
        f = line.split()
        if len(f) < 10:
            continue
        try:
            local, lport = _proc_addr(family, f[1])
            remote, rport = _proc_addr(family, f[2])
            state = int(f[3], 16)
            rq = int(f[4].split(":")[1], 16)
            out.append(TcpSocket(family, state, local, lport, remote, rport, int(f[7]), int(f[9]), None, rq))
        except (ValueError, IndexError):
            continue
    return out


def _proc_sockets(proc: str) -> list[TcpSocket]:
    out: list[TcpSocket] = []
    for name, fam in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(os.path.join(proc, "net", name)) as f:
                out.extend(parse_proc_net_tcp(f.read(), fam))
        except OSError:
            continue
    return out


# -------------------------------------------------------------------- shells


def listening_sockets(port: int | None = None, *, proc: str = "/proc") -> list[TcpSocket]:
    """Every TCP listener of this network namespace (on ``port`` when given)."""
    try:
        socks = _netlink(_request(fam, 1 << TCP_LISTEN, seq=i + 1)
                         for i, fam in enumerate((socket.AF_INET, socket.AF_INET6)))
    except OSError:
        socks = [s for s in _proc_sockets(proc) if s.state == TCP_LISTEN]
    return [s for s in socks if s.state == TCP_LISTEN and (port is None or s.local_port == port)]


def find_connection(family: int, local: str, local_port: int, remote: str, remote_port: int) -> TcpSocket | None:
    """The socket with exactly this 4-tuple (e.g. the server side of our own probe connection)."""
    sid = _SOCKID.pack(local_port, remote_port, _addr_bytes(family, local), _addr_bytes(family, remote), 0,
                       struct.pack("=II", INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE))
    try:
        got = _netlink([_request(family, 0xFFFFFFFF, seq=1, sockid=sid)])
    except OSError:
        got = [s for s in _proc_sockets("/proc") if s.family == family]
    for s in got:
        if (s.local_port, s.remote_port) == (local_port, remote_port) and s.local == local and s.remote == remote:
            return s
    return None


def socket_inodes_of(pid: int, *, proc: str = "/proc") -> Iterator[int]:
    """Inodes of the sockets process ``pid`` holds open (nothing when unreadable)."""
    d = os.path.join(proc, str(pid), "fd")
    try:
        names = os.listdir(d)
    except OSError:
        return
    for n in names:
        try:
            target = os.readlink(os.path.join(d, n))
        except OSError:
            continue
        if target.startswith("socket:["):
            try:
                yield int(target[8:-1])
            except ValueError:
                continue
