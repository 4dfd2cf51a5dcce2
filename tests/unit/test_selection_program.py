"""The selection program on real SO_REUSEPORT sockets (loopback, no privilege)."""

import collections
import select
import socket

import pytest

from numaserve.net.steering import (
    HASH_FALLBACK,
    attach_reuseport_cbpf,
    build_selection_program,
    detach_reuseport_bpf,
)

KNUTH = 2654435761


def spread_index(sport: int, n: int) -> int:
    return (((sport * KNUTH) & 0xFFFFFFFF) >> 16) % n


def test_no_program_when_everyone_is_healthy_or_nobody_is():
    assert build_selection_program(healthy=[0, 1, 2], group_size=3) is None
    assert build_selection_program(healthy=[], group_size=3) is None


def test_numa_table_with_all_healthy_ends_in_hash_fallback():
    prog = build_selection_program(healthy=[0, 1], group_size=2, cpu_to_pos={0: 0, 1: 1})
    assert prog is not None and prog[-1][3] == HASH_FALLBACK


def test_rejects_positions_outside_group():
    with pytest.raises(ValueError):
        build_selection_program(healthy=[3], group_size=2)


@pytest.mark.parametrize("family,host", [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_unhealthy_slot_gets_no_new_connection(family, host):
    try:
        probe = socket.socket(family)
        probe.bind((host, 0))
        probe.close()
    except OSError:
        pytest.skip(f"{host} not available")
    listeners, port = [], 0
    for _ in range(3):
        s = socket.socket(family)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((host, port))
        port = s.getsockname()[1]
        s.listen(256)
        s.setblocking(False)
        listeners.append(s)
    try:
        attach_reuseport_cbpf(listeners[0], build_selection_program(healthy=[0, 2], group_size=3,
                                                                     ipv6=family == socket.AF_INET6))
        counts: collections.Counter[int] = collections.Counter()
        for _ in range(200):
            c = socket.socket(family)
            c.connect((host, port))
            sport = c.getsockname()[1]
            select.select(listeners, [], [], 2)
            got = None
            for i, lst in enumerate(listeners):
                try:
                    a, _ = lst.accept()
                    a.close()
                    got = i
                except BlockingIOError:
                    pass
            assert got == [0, 2][spread_index(sport, 2)]
            counts[got] += 1
            c.close()
        assert counts[1] == 0 and counts[0] > 40 and counts[2] > 40
        assert detach_reuseport_bpf(listeners[0]) is True
    finally:
        for s in listeners:
            s.close()
