"""NUMA connection steering on this machine: two pretend nodes on two real CPUs."""

from __future__ import annotations

import collections
import http.client
import json
import os
import signal
import threading
from pathlib import Path

import pytest

from tests.integration.harness import EXEC_WORKERS, FAST_CONFIG, Running, two_pretend_nodes

pytestmark = pytest.mark.slow


def _declared(tmp_path: Path) -> Path:
    return two_pretend_nodes(tmp_path)[0]


def served_nodes(port: int, cpu: int, n: int) -> collections.Counter[int]:
    """n requests, each on a new connection, from a thread pinned to ``cpu``."""
    out: collections.Counter[int] = collections.Counter()

    def run() -> None:
        os.sched_setaffinity(0, {cpu})
        for _ in range(n):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                c.request("GET", "/", headers={"Connection": "close"})
                r = c.getresponse()
                out[json.loads(r.read())["node"] if r.status == 200 else -r.status] += 1
            finally:
                c.close()

    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    return out


def test_numa_steering_serves_on_the_receiving_node(tmp_path: Path) -> None:
    declared = _declared(tmp_path)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    # exec'd workers: a forked replacement serves again within ~0.1 s, too soon to watch the window
    # in which the other node serves this node's clients (test_template.py covers forked replacements)
    with Running(["--declared", str(declared), "--steering", "numa", "--bind", "127.0.0.1:0"],
                 config=FAST_CONFIG + EXEC_WORKERS) as sup:
        sup.wait_for(lambda st: st["supervisor"]["steering"]["program_attached"], 10, "program attached")
        for node, cpu in enumerate(cpus):
            got = served_nodes(sup.port, cpu, 100)
            assert got[node] >= 99, (cpu, got)
        # a worker dies: its node's clients are served by the other node meanwhile, nothing fails
        victim = sup.slots()[1]
        os.kill(victim["pid"], signal.SIGKILL)
        sup.wait_for(lambda st: st["slots"][1]["state"] != "ready", 10, "slot 1 down")
        during = served_nodes(sup.port, cpus[1], 30)
        assert sum(v for k, v in during.items() if k >= 0) == 30, during
        sup.wait_for(lambda st: st["slots"][1]["state"] == "ready" and st["slots"][1]["generation"] == 2, 30,
                     "slot 1 replaced")
        sup.wait_for(lambda st: st["supervisor"]["steering"]["healthy_slots"] == [0, 1], 10, "steering restored")
        after = served_nodes(sup.port, cpus[1], 100)
        assert after[1] >= 99, after
        # status reports the share of connections accepted on their receiving node
        st = sup.wait_for(lambda st: (st["supervisor"]["steering"]["connections_local"] or 0) >= 200, 10,
                          "locality counted")
        steer = st["supervisor"]["steering"]
        assert steer["locality_share"] >= 0.8, steer
        assert all(s["totals"]["locality_share"] is not None for s in st["slots"])


def test_hash_steering_spreads_regardless_of_cpu(tmp_path: Path) -> None:
    declared = _declared(tmp_path)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    with Running(["--declared", str(declared), "--steering", "hash", "--bind", "127.0.0.1:0"]) as sup:
        got = served_nodes(sup.port, cpus[0], 200)
        assert 40 <= got[1] <= 160, got      # about half land on the other node
        st = sup.wait_for(lambda st: (st["supervisor"]["steering"]["connections_local"] or 0)
                          + (st["supervisor"]["steering"]["connections_remote"] or 0) >= 190, 10, "counted")
        assert 0.2 <= st["supervisor"]["steering"]["locality_share"] <= 0.8, st["supervisor"]["steering"]


def test_numa_steering_survives_drain_and_undrain(tmp_path: Path) -> None:
    declared = _declared(tmp_path)
    cpus = sorted(os.sched_getaffinity(0))[:2]
    with Running(["--declared", str(declared), "--steering", "numa", "--bind", "127.0.0.1:0"]) as sup:
        r = sup.ops("drain", "--node", "1", "--wait", timeout=60)
        assert r.returncode == 0, r.stderr
        during = served_nodes(sup.port, cpus[1], 50)
        assert during == {0: 50}, during                 # node 1 drained: its clients go to node 0
        r = sup.ops("undrain", "--node", "1", "--wait", timeout=60)
        assert r.returncode == 0, r.stderr
        after = served_nodes(sup.port, cpus[1], 100)
        assert after[1] >= 99, after
