"""Port owners: overlap rules on data, the socket tables and owners on real sockets."""

import os
import socket
import struct

import pytest

from numaserve.errors import UsageError
from numaserve.net.listeners import BindAddress, resolve_bind, resolve_binds
from numaserve.net.portowners import Owner, check_binds, conflicts, overlaps, owners
from numaserve.net.sockdiag import (
    TCP_LISTEN,
    TcpSocket,
    find_connection,
    listening_sockets,
    parse_diag_messages,
    parse_proc_net_tcp,
)

V4, V6 = socket.AF_INET, socket.AF_INET6


def ours(host, port=8000, fam=V4):
    return BindAddress(f"{host}:{port}", host, port, fam)


def theirs(host, port=8000, fam=V4, v6only=None, inode=7):
    return TcpSocket(fam, TCP_LISTEN, host, port, "0.0.0.0" if fam == V4 else "::", 0, 1000, inode, v6only)


@pytest.mark.parametrize("mine,other,expected", [
    (ours("127.0.0.1"), theirs("127.0.0.1"), True),
    (ours("127.0.0.1"), theirs("0.0.0.0"), True),         # the wildcard takes what the specific does not
    (ours("0.0.0.0"), theirs("127.0.0.1"), True),         # the specific wins every 127.0.0.1 connection
    (ours("127.0.0.1"), theirs("10.0.0.1"), False),
    (ours("127.0.0.1"), theirs("127.0.0.1", port=8001), False),
    (ours("127.0.0.1"), theirs("::", fam=V6, v6only=False), True),   # dual-stack takes IPv4 too
    (ours("127.0.0.1"), theirs("::", fam=V6, v6only=True), False),
    (ours("127.0.0.1"), theirs("::", fam=V6, v6only=None), True),    # unknown: assume dual-stack
    (ours("127.0.0.1"), theirs("::ffff:127.0.0.1", fam=V6), True),
    (ours("::1", fam=V6), theirs("::1", fam=V6), True),
    (ours("::1", fam=V6), theirs("::", fam=V6, v6only=True), True),
    (ours("::", fam=V6), theirs("0.0.0.0"), False),      # ours are v6-only
    (ours("::", fam=V6), theirs("::ffff:127.0.0.1", fam=V6), False),
    (ours("::1", fam=V6), theirs("fe80::1", fam=V6), False),
])
def test_overlap_rules(mine, other, expected):
    assert overlaps(mine, other) is expected


def test_conflicts_skip_our_own_inodes():
    socks = [theirs("127.0.0.1", inode=1), theirs("0.0.0.0", inode=2)]
    assert [c.theirs.inode for c in conflicts([ours("127.0.0.1")], socks, own_inodes={1})] == [2]


def test_check_binds_refuses_with_the_owner_named_and_allows_a_takeover():
    b = ours("127.0.0.1", port=1)      # never bound for real: the table and owners are given
    socks = [theirs("0.0.0.0", port=1, inode=42)]
    table = {42: [Owner(4242, "python3 -m numaserve start")]}
    import numaserve.net.portowners as P

    real = P._test_bind
    P._test_bind = lambda b: None
    try:
        with pytest.raises(UsageError) as e:
            check_binds([b], listeners=socks, owner_lookup=table)
        msg = str(e.value)
        assert "pid 4242 (python3 -m numaserve start)" in msg and "0.0.0.0:1" in msg and "--takeover" in msg
        warnings = check_binds([b], takeover=True, listeners=socks, owner_lookup=table)
        assert len(warnings) == 1 and "pid 4242" in warnings[0]
        unreadable = check_binds([b], takeover=True, listeners=socks, owner_lookup={})
        assert "uid 1000" in unreadable[0] and "inode 42" in unreadable[0]
        assert check_binds([ours("127.0.0.1", port=0)], listeners=socks, owner_lookup=table) == []
    finally:
        P._test_bind = real


def _listener(host="127.0.0.1", fam=V4, reuseport=True, v6only=True):
    s = socket.socket(fam)
    if reuseport:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if fam == V6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1 if v6only else 0)
    s.bind((host, 0))
    s.listen()
    return s


def test_real_sockets_are_found_refused_and_owned_by_us():
    a = _listener()
    port = a.getsockname()[1]
    try:
        found = [s for s in listening_sockets(port) if s.local == "127.0.0.1"]
        assert len(found) == 1 and found[0].inode == os.fstat(a.fileno()).st_ino
        assert owners([found[0].inode])[found[0].inode][0].pid == os.getpid()
        with pytest.raises(UsageError, match=f"pid {os.getpid()}"):
            check_binds([resolve_bind(f"127.0.0.1:{port}")])
        assert check_binds([resolve_bind(f"127.0.0.1:{port}")], takeover=True)
    finally:
        a.close()
    assert check_binds([resolve_bind(f"127.0.0.1:{port}")]) == []


def test_a_listener_without_reuseport_is_address_in_use_with_its_owner():
    a = _listener(reuseport=False)
    port = a.getsockname()[1]
    try:
        with pytest.raises(UsageError, match="address in use.*pid"):
            check_binds([resolve_bind(f"127.0.0.1:{port}")], takeover=True)
    finally:
        a.close()


def test_v6only_flag_comes_from_netlink():
    try:
        a = _listener("::", V6, v6only=True)
        b = _listener("::", V6, v6only=False)
    except OSError:
        pytest.skip("no IPv6")
    try:
        got = {s.local_port: s.v6only for s in listening_sockets() if s.family == V6}
        assert got[a.getsockname()[1]] is True and got[b.getsockname()[1]] is False
    finally:
        a.close()
        b.close()


def test_find_connection_sees_the_accept():
    a = _listener()
    port = a.getsockname()[1]
    c = socket.create_connection(("127.0.0.1", port))
    try:
        cport = c.getsockname()[1]
        queued = find_connection(V4, "127.0.0.1", port, "127.0.0.1", cport)
        assert queued is not None and queued.inode == 0       # waiting in the accept queue
        conn, _ = a.accept()
        got = find_connection(V4, "127.0.0.1", port, "127.0.0.1", cport)
        assert got is not None and got.inode == os.fstat(conn.fileno()).st_ino
        conn.close()
        assert find_connection(V4, "127.0.0.1", port, "127.0.0.1", 1) is None
    finally:
        c.close()
        a.close()


def test_proc_net_tcp_parsing():
    text = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
            "   0: 0100007F:1F90 00000000:0000 0A 00000000:00000003 00:00000000 00000000  1000        0 4242 1\n"
            "   1: garbage\n")
    (s,) = parse_proc_net_tcp(text, V4)
    assert (s.local, s.local_port, s.state, s.uid, s.inode, s.rqueue) == ("127.0.0.1", 8080, TCP_LISTEN, 1000, 4242, 3)
    text6 = ("  sl  local_address                         remote_address                        st tx_queue rx_queue "
             "tr tm->when retrnsmt   uid  timeout inode\n"
             "   0: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A "
             "00000000:00000000 00:00000000 00000000     0        0 77 1\n")
    (s6,) = parse_proc_net_tcp(text6, V6)
    assert (s6.local, s6.local_port, s6.inode, s6.v6only) == ("::1", 8080, 77, None)


def test_diag_parser_handles_error_and_done():
    err = struct.pack("=IHHII", 20, 2, 0, 1, 0) + struct.pack("=i", -1)
    assert parse_diag_messages(err) == ([], True, 1)
    done = struct.pack("=IHHII", 20, 3, 0, 1, 0) + b"\0\0\0\0"
    assert parse_diag_messages(done) == ([], True, 0)


@pytest.mark.parametrize("text,fragment", [
    ("300.1.1.1:80", "not a valid IPv4 address"),
    ("1.2.3:80", "not a valid IPv4 address"),
    ("no-such-host.invalid:80", "cannot resolve host"),
    ("127.0.0.1:99999", "0-65535"),
])
def test_resolve_bind_errors_are_usage_errors(text, fragment):
    with pytest.raises(UsageError, match=fragment):
        resolve_bind(text)


def test_resolve_binds_refuses_the_same_address_twice_and_keeps_port_zero():
    with pytest.raises(UsageError, match="same address"):
        resolve_binds(["127.0.0.1:8000", "localhost:8000"] if socket.gethostbyname("localhost") == "127.0.0.1"
                      else ["127.0.0.1:8000", "127.0.0.1:8000"])
    assert len(resolve_binds(["127.0.0.1:0", "127.0.0.1:0"])) == 2
    b = resolve_bind("[::1]:8000")
    assert (b.host, b.family, b.address) == ("::1", V6, "[::1]:8000")
    assert resolve_bind(":8000").host == "0.0.0.0"


def test_bind_to_a_foreign_address_is_refused_before_anything():
    with pytest.raises(UsageError, match="no such address"):
        check_binds([resolve_bind("192.0.2.123:8000")])   # TEST-NET-1: never local
