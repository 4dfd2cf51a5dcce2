"""CBPF reuseport steering: the pure builders, and real SO_REUSEPORT listeners
on 127.0.0.1 with a client thread pinned per CPU.

On loopback the sending CPU runs the RX softirq (FACTS §7.4), so a client
pinned to CPU k makes ``SKF_AD_CPU`` = k for its SYN: exactly what the
table program keys on.
"""

from __future__ import annotations

import os
import select
import socket
import threading
from collections import Counter

import pytest

from numaserve.net.steering import (
    BPF_MAXINSNS,
    HASH_FALLBACK,
    ProgramTooLarge,
    attach_reuseport_cbpf,
    build_cpu_table_program,
    detach_reuseport_bpf,
    group_positions_after_close,
    loopback_collapse_check,
    numa_cpu_to_slot,
)

N = 200  # connections per CPU


# --- pure -----------------------------------------------------------------------------


def test_program_exact_encoding() -> None:
    assert build_cpu_table_program({1: 1, 0: 0}) == [
        (0x20, 0, 0, 0xFFFFF024),  # ld [SKF_AD_OFF + SKF_AD_CPU], k = -4060 as u32
        (0x15, 0, 1, 0), (0x06, 0, 0, 0),
        (0x15, 0, 1, 1), (0x06, 0, 0, 1),
        (0x06, 0, 0, 0xFFFFFFFF),
    ]
    assert build_cpu_table_program({}) == [(0x20, 0, 0, 0xFFFFF024), (0x06, 0, 0, HASH_FALLBACK)]


def test_program_size_limit() -> None:
    ok = build_cpu_table_program({c: 0 for c in range(2047)})
    assert len(ok) == BPF_MAXINSNS
    with pytest.raises(ProgramTooLarge, match="2048 CPUs needs 4098 instructions.*BPF_MAXINSNS"):
        build_cpu_table_program({c: 0 for c in range(2048)})
    with pytest.raises(ValueError):
        build_cpu_table_program({-1: 0})


def test_numa_cpu_to_slot_round_robin_and_group_positions() -> None:
    cpu_node = {0: 0, 1: 0, 2: 1, 3: 1, 4: 0, 5: 1, 8: 2}
    node_slots = {0: [0, 1], 1: [2], 2: [9]}
    # slot -> group position (listen order 2, 0, 1 ⇒ slot 2 at position 0)
    group = {2: 0, 0: 1, 1: 2}
    table = numa_cpu_to_slot(cpu_node, node_slots, group)
    assert table == {0: 1, 1: 2, 4: 1, 2: 0, 3: 0, 5: 0}  # node 0 CPUs 0,1,4 over slots 0,1; CPU 8 → hash
    assert numa_cpu_to_slot(cpu_node, {0: [], 1: [2]}, group) == {2: 0, 3: 0, 5: 0}
    assert numa_cpu_to_slot({0: 0}, {0: [7, 0]}, {0: 3}) == {0: 3}  # slot 7 not in the group: skipped


def test_group_positions_after_close() -> None:
    assert group_positions_after_close([0, 1, 2], 0) == [2, 1]
    assert group_positions_after_close([0, 1, 2], 2) == [0, 1]
    assert group_positions_after_close([5], 5) == []


def test_collapse_check() -> None:
    v = loopback_collapse_check({0: 400, 1: 2})
    assert v.collapsed and v.dominant == 0 and v.share > 0.99 and "detach" in v.reason
    assert not loopback_collapse_check({0: 210, 1: 190}).collapsed
    assert not loopback_collapse_check({0: 50}, expected_slots=[0, 1]).collapsed  # too few
    assert loopback_collapse_check({0: 300}, expected_slots=[0, 1]).collapsed
    assert not loopback_collapse_check({0: 1000}).collapsed  # a single slot cannot collapse


# --- real sockets -------------------------------------------------------------------------

CPUS = sorted(os.sched_getaffinity(0))
needs2 = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 usable CPUs")


def make_group(n: int, listen_order: list[int] | None = None) -> list[socket.socket]:
    """n SO_REUSEPORT TCP sockets on one 127.0.0.1 port; listen() in ``listen_order``."""
    socks: list[socket.socket] = []
    port = 0
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", port))
        port = s.getsockname()[1]
        s.setblocking(False)
        socks.append(s)
    for i in listen_order or range(n):
        socks[i].listen(1024)
    return socks


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


def connect_from(cpu: int, socks: list[socket.socket], n: int = N) -> tuple[Counter[int], Counter[int]]:
    """Connect n times from a thread pinned to ``cpu``; count which socket accepted
    and the accepted sockets' SO_INCOMING_CPU."""
    port = socks[0].getsockname()[1]
    hits: Counter[int] = Counter()
    incoming: Counter[int] = Counter()
    err: list[BaseException] = []

    def run() -> None:
        try:
            os.sched_setaffinity(0, {cpu})  # this thread only
            for _ in range(n):
                c = socket.create_connection(("127.0.0.1", port), timeout=5)
                ready, _, _ = select.select(socks, [], [], 5)
                assert ready, "no listener got the connection"
                for s in ready:
                    try:
                        a, _ = s.accept()
                    except BlockingIOError:
                        continue
                    hits[socks.index(s)] += 1
                    incoming[a.getsockopt(socket.SOL_SOCKET, socket.SO_INCOMING_CPU)] += 1
                    a.close()
                c.close()
        except BaseException as e:  # pragma: no cover - reported below
            err.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not t.is_alive() and not err, err
    assert sum(hits.values()) == n
    return hits, incoming


@needs2
def test_table_steers_by_cpu_and_incoming_cpu_matches() -> None:
    a, b = CPUS[0], CPUS[1]
    socks = make_group(2)
    try:
        attach_reuseport_cbpf(socks[1], build_cpu_table_program({a: 0, b: 1}))  # via any member
        hits, inc = connect_from(a, socks)
        assert hits[0] >= 0.99 * N, hits
        assert inc[a] >= 0.99 * N, inc
        hits, inc = connect_from(b, socks)
        assert hits[1] >= 0.99 * N, hits
        assert inc[b] >= 0.99 * N, inc
    finally:
        close_all(socks)


@needs2
def test_no_program_hashes_and_detach_restores_hashing() -> None:
    a, b = CPUS[0], CPUS[1]
    socks = make_group(2)
    try:
        assert detach_reuseport_bpf(socks[0]) is False  # nothing attached yet
        hits, _ = connect_from(a, socks, 2 * N)
        assert min(hits[0], hits[1]) >= 0.2 * 2 * N, hits  # roughly half each (loose)
        attach_reuseport_cbpf(socks[0], build_cpu_table_program({a: 0, b: 0}))
        for cpu in (a, b):
            hits, _ = connect_from(cpu, socks)
            assert hits[0] >= 0.99 * N, (cpu, hits)  # "all → 0"
        assert detach_reuseport_bpf(socks[1]) is True
        hits, _ = connect_from(b, socks, 2 * N)
        assert min(hits[0], hits[1]) >= 0.2 * 2 * N, hits
    finally:
        close_all(socks)


@needs2
def test_missing_cpu_and_out_of_range_slot_fall_back_to_hash() -> None:
    a, b = CPUS[0], CPUS[1]
    socks = make_group(2)
    try:
        attach_reuseport_cbpf(socks[0], build_cpu_table_program({a: 1}))
        hits, _ = connect_from(a, socks)
        assert hits[1] >= 0.99 * N, hits
        hits, _ = connect_from(b, socks, 2 * N)  # b not in the table → hash
        assert min(hits[0], hits[1]) >= 0.2 * 2 * N, hits
        attach_reuseport_cbpf(socks[0], build_cpu_table_program({a: 7, b: 7}))  # 7 >= group size → hash
        hits, _ = connect_from(a, socks, 2 * N)
        assert min(hits[0], hits[1]) >= 0.2 * 2 * N, hits
    finally:
        close_all(socks)


@needs2
def test_group_position_is_listen_order_and_last_moves_into_hole() -> None:
    """FACTS §7.1 on this kernel: position = listen() order; closing moves the last socket into the hole."""
    a = CPUS[0]
    socks = make_group(3, listen_order=[2, 0, 1])  # positions: 0 → socks[2], 1 → socks[0], 2 → socks[1]
    try:
        attach_reuseport_cbpf(socks[0], build_cpu_table_program({a: 0}))
        hits, _ = connect_from(a, socks, 50)
        assert hits[2] == 50, hits
        # via numa_cpu_to_slot: slot i = socks[i]; group_index from the listen order
        order = [2, 0, 1]
        group = {s: i for i, s in enumerate(order)}
        attach_reuseport_cbpf(socks[0], build_cpu_table_program(numa_cpu_to_slot({a: 0}, {0: [1]}, group)))
        hits, _ = connect_from(a, socks, 50)
        assert hits[1] == 50, hits
        # close the socket at position 0 (socks[2]); socks[1] (last) moves to position 0
        order = group_positions_after_close(order, 2)
        assert order == [1, 0]
        socks[2].close()
        live = [socks[0], socks[1]]
        attach_reuseport_cbpf(socks[0], build_cpu_table_program({a: 0}))
        hits, _ = connect_from(a, live, 50)
        assert hits[1] == 50, hits  # live[1] is socks[1]
    finally:
        close_all(socks)


def test_attach_on_fd_and_errors() -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        attach_reuseport_cbpf(s.fileno(), build_cpu_table_program({0: 0}))  # int fd: borrowed, not closed
        assert s.fileno() >= 0
        assert detach_reuseport_bpf(s.fileno()) is True
        with pytest.raises(ValueError):
            attach_reuseport_cbpf(s, [])
        with pytest.raises(OSError):  # jump out of range: the kernel's checker rejects it
            attach_reuseport_cbpf(s, [(0x15, 5, 5, 0), (0x06, 0, 0, 0)])
    finally:
        s.close()
