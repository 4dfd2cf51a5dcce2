"""The steering hot set: a crowded node (more workers than CPUs) gives new connections to a few
of its slots, spills when one of them refuses work or stalls, shrinks back after a quiet hold,
and keeps the NUMA guarantee (a node's connections stay on the node).  Pure parts on data,
then ``Steering`` on real SO_REUSEPORT listeners."""

from __future__ import annotations

import collections
import select
import socket
from typing import Any

from numaserve.control.messages import Stats
from numaserve.net.listeners import open_listeners
from numaserve.net.steering import hot_set
from numaserve.supervisor.steer import AVOID_S, SPILL_HOLD_S, HotSet, Steering

ONE_NODE = {s: 0 for s in range(8)}


def stats(slot: int, *, gen: int = 1, cpu: int = 0, stall: int = 0, stalls: int = 0, quota: int = 0,
          connections: int = 0) -> Stats:
    adm: dict[str, Any] = {"shed": {"cpu": cpu, "stalled": stall, "quota": quota},
                           "sentinel": {"shed": stall, "stalls": stalls}}
    return Stats(slot=slot, generation=gen, requests=0, inflight=0, connections=connections,
                 extra={"admission": adm})


# --- hot_set (pure) --------------------------------------------------------------------------


def test_hot_set_takes_as_many_slots_as_cpus_per_crowded_node() -> None:
    assert hot_set(range(8), ONE_NODE, {0: 2}) == (0, 1)
    two = {s: s // 4 for s in range(8)}               # node 0: slots 0-3, node 1: 4-7
    assert hot_set(range(8), two, {0: 1, 1: 2}) == (0, 4, 5)
    assert hot_set([0, 1, 5], two, {0: 2, 1: 2}) == (0, 1, 5)    # not crowded: all healthy
    assert hot_set(range(8), two, {0: 2}) == (0, 1, 4, 5, 6, 7)  # node 1 has no size: never concentrated
    assert hot_set(range(8), ONE_NODE, {0: 0}) == (0,)          # at least one slot per node


def test_hot_set_keeps_current_members_and_skips_avoided() -> None:
    assert hot_set(range(8), ONE_NODE, {0: 2}, keep=(3, 6)) == (3, 6)
    assert hot_set(range(8), ONE_NODE, {0: 2}, keep=(3, 6), avoid=(3,)) == (0, 6)
    # a slot that is no longer healthy leaves the set; the next one takes its place
    assert hot_set([0, 2, 3, 4], ONE_NODE, {0: 2}, keep=(1, 2)) == (0, 2)
    # everything avoided: still serve from the node (avoided ones are last, not excluded)
    assert hot_set([0, 1], ONE_NODE, {0: 1}, avoid=(0, 1)) == (0,)


# --- HotSet (spill and shrink) ---------------------------------------------------------------


def test_refusals_spill_the_set_and_quiet_shrinks_it_back() -> None:
    hs = HotSet({0: 2}, ONE_NODE)
    assert hs.crowded()
    assert hs.pick(0.0, range(8)) == (0, 1)
    hs.observe(0.0, {0: stats(0), 1: stats(1)})          # first stats of each worker: the baseline
    assert hs.pick(0.0, range(8)) == (0, 1)
    hs.observe(1.0, {0: stats(0, quota=5), 1: stats(1)})  # quota refusals: more workers would not help
    assert hs.pick(1.0, range(8)) == (0, 1)
    hs.observe(2.0, {0: stats(0, cpu=3, quota=5), 1: stats(1)})
    assert hs.pick(2.0, range(8)) == (0, 1, 2, 3)         # doubled, the current members kept
    hs.observe(3.0, {s: stats(s, cpu=3 if s == 0 else 1) for s in range(4)})  # baselines of 2, 3; 1 refused
    assert hs.pick(3.0, range(8)) == tuple(range(8))
    hs.observe(3.0 + SPILL_HOLD_S - 1, {})
    assert len(hs.pick(3.0 + SPILL_HOLD_S - 1, range(8))) == 8
    hs.observe(3.0 + SPILL_HOLD_S, {})
    assert hs.pick(3.0 + SPILL_HOLD_S, range(8)) == (0, 1, 2, 3)
    hs.observe(3.0 + 2 * SPILL_HOLD_S, {})
    assert hs.pick(3.0 + 2 * SPILL_HOLD_S, range(8)) == (0, 1)
    hs.observe(3.0 + 5 * SPILL_HOLD_S, {})
    assert hs.pick(3.0 + 5 * SPILL_HOLD_S, range(8)) == (0, 1)   # never below the CPU count
    assert hs.spills == 2


def test_a_stalled_worker_leaves_the_set_for_a_while() -> None:
    hs = HotSet({0: 2}, ONE_NODE)
    hs.pick(0.0, range(8))
    hs.observe(0.0, {0: stats(0), 1: stats(1)})
    hs.observe(1.0, {0: stats(0, stall=4, stalls=1), 1: stats(1)})
    got = hs.pick(1.0, range(8))
    assert 0 not in got and len(got) == 4 and 1 in got
    assert hs.status()["avoided"] == [0]
    hs.observe(1.0 + SPILL_HOLD_S, {})   # quiet: back to 2 slots; slot 0 still avoided
    assert 0 not in hs.pick(1.0 + SPILL_HOLD_S, range(8))
    later = 1.0 + AVOID_S + 2 * SPILL_HOLD_S
    assert hs.pick(later, range(8)) == (1, 2)       # the set stays where its connections are ...
    assert hs.status()["avoided"] == []
    assert hs.pick(later, [0, 2, 3]) == (0, 2)      # ... and slot 0 may serve again


def test_a_replaced_worker_and_a_repeated_message_are_no_refusal() -> None:
    hs = HotSet({0: 2}, ONE_NODE)
    hs.pick(0.0, range(8))
    hs.observe(0.0, {0: stats(0, cpu=50), 1: stats(1)})
    same = stats(0, gen=2)                               # new generation: counters restart at 0
    hs.observe(1.0, {0: same, 1: stats(1)})
    hs.observe(2.0, {0: same, 1: stats(1)})
    assert hs.pick(2.0, range(8)) == (0, 1)
    hs.observe(3.0, {0: stats(0, gen=2, cpu=1), 1: stats(1)})
    assert len(hs.pick(3.0, range(8))) == 4


def test_a_full_worker_spills() -> None:
    hs = HotSet({0: 2}, ONE_NODE, max_connections=10)
    hs.pick(0.0, range(8))
    hs.observe(0.0, {0: stats(0, connections=8), 1: stats(1, connections=3)})
    assert len(hs.pick(0.0, range(8))) == 2
    hs.observe(1.0, {0: stats(0, connections=9), 1: stats(1, connections=3)})   # 90 % of its cap
    assert len(hs.pick(1.0, range(8))) == 4


def test_not_crowded_means_no_hot_set() -> None:
    assert not HotSet({0: 8}, ONE_NODE).crowded()
    assert not HotSet({}, ONE_NODE).crowded()


# --- Steering on real listeners -----------------------------------------------------------------


def _accepted_by(ls: Any, n: int) -> collections.Counter[int]:
    port = ls.by_slot[0][0].port
    socks = {slot: lst[0].sock for slot, lst in ls.by_slot.items()}
    got: collections.Counter[int] = collections.Counter()
    for _ in range(n):
        c = socket.create_connection(("127.0.0.1", port), timeout=5)
        ready, _, _ = select.select(list(socks.values()), [], [], 5)
        assert ready
        for slot, s in socks.items():
            if s in ready:
                try:
                    a, _ = s.accept()
                except BlockingIOError:
                    continue
                a.close()
                got[slot] += 1
        c.close()
    return got


def test_crowded_node_sends_new_connections_to_its_hot_slots_then_spills() -> None:
    ls = open_listeners(["127.0.0.1:0"], list(range(6)), 64)
    try:
        st = Steering(ls, slot_node={s: 0 for s in range(6)}, node_cpus={0: 2})
        assert st.hot is not None
        st.update(range(6), stats={s: stats(s) for s in range(6)}, now=0.0)
        assert st.targets == (0, 1) and st.attached
        got = _accepted_by(ls, 120)
        assert set(got) == {0, 1} and min(got.values()) > 20, got
        st.update(range(6), stats={0: stats(0, cpu=2), 1: stats(1)}, now=1.0)
        assert st.targets == (0, 1, 2, 3)
        assert set(_accepted_by(ls, 120)) == {0, 1, 2, 3}
        st.update([1, 2, 3, 4, 5], now=2.0)               # slot 0 stopped serving: never a target
        assert 0 not in st.targets and len(st.targets) == 4
        assert st.status()["hot_set"]["slots"] == list(st.targets)
    finally:
        ls.close()


def test_numa_mode_hot_set_keeps_connections_on_their_node() -> None:
    ls = open_listeners(["127.0.0.1:0"], list(range(8)), 64)
    try:
        slot_node = {s: s // 4 for s in range(8)}
        cpu_node = {0: 0, 1: 1}
        st = Steering(ls, mode="numa", cpu_node=cpu_node, slot_node=slot_node, node_cpus={0: 1, 1: 1})
        st.update(range(8), now=0.0)
        assert st.targets == (0, 4)
        prog = st.program_for(st.targets, False)
        assert prog is not None
        # CPU 0 (node 0) -> slot 0, CPU 1 (node 1) -> slot 4: the table, nothing of the other node
        assert (0x15, 0, 1, 0) in prog and (0x06, 0, 0, 0) in prog
        assert (0x15, 0, 1, 1) in prog and (0x06, 0, 0, 4) in prog
    finally:
        ls.close()


def test_concentrate_off_or_enough_cpus_leaves_every_slot_a_target() -> None:
    ls = open_listeners(["127.0.0.1:0"], list(range(4)), 64)
    try:
        st = Steering(ls, slot_node={s: 0 for s in range(4)}, node_cpus={})
        st.update(range(4))
        assert st.hot is None and st.targets == (0, 1, 2, 3) and not st.attached
        st.set_crowd({0: 2})
        st.update(range(4))
        assert st.targets == (0, 1) and st.attached
        st.set_crowd({0: 4})
        st.update(range(4))
        assert st.hot is None and st.targets == (0, 1, 2, 3) and not st.attached
    finally:
        ls.close()


def test_hot_set_spreads_over_the_node_cpus() -> None:
    # split placement: CPUs dealt round-robin, slots 0, 2, 4 on CPU 0 and 1, 3, 5 on CPU 1
    cpus = {s: (s % 2,) for s in range(6)}
    node = {s: 0 for s in range(6)}
    assert hot_set(range(6), node, {0: 2}, slot_cpus=cpus) == (0, 1)
    # the current set has two workers of CPU 0: one of them gives way to a CPU-1 worker
    assert hot_set(range(6), node, {0: 2}, keep=(0, 2), slot_cpus=cpus) == (0, 1)
    assert hot_set([0, 2, 4, 5], node, {0: 2}, keep=(2, 4), slot_cpus=cpus) == (2, 5)
    # no CPU left uncovered: rank order (kept members first)
    assert hot_set(range(6), node, {0: 4}, keep=(4,), slot_cpus=cpus) == (0, 1, 2, 4)
    assert hot_set([0, 2, 4], node, {0: 2}, slot_cpus=cpus) == (0, 2)
    # shared placement: every slot on both CPUs, nothing to spread
    both = {s: (0, 1) for s in range(6)}
    assert hot_set(range(6), node, {0: 2}, keep=(3, 5), slot_cpus=both) == (3, 5)
