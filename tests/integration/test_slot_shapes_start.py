"""`numaserve start --slots core` on this machine: one worker per physical core of a
declared node, each pinned to its core, memory bound to the node, each serving."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.integration.harness import Running, http_get

pytestmark = pytest.mark.slow


def _one_node_two_cores(tmp_path: Path) -> tuple[Path, list[int]]:
    """Pretend node 0 = this machine's first two usable CPUs, when they are two cores."""
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs 2 usable CPUs")
    sib = Path(f"/sys/devices/system/cpu/cpu{cpus[0]}/topology/thread_siblings_list")
    if sib.is_file() and str(cpus[1]) in sib.read_text().replace("-", ",").split(","):
        pytest.skip("the first two usable CPUs are SMT siblings of one core")
    p = tmp_path / "topo.toml"
    p.write_text(f'mode = "replace"\n[[node]]\nid = 0\ncpus = "{cpus[0]},{cpus[1]}"\nmemory_node = 0\n')
    return p, cpus


def test_core_slots_start_pin_and_serve(tmp_path: Path) -> None:
    declared, cpus = _one_node_two_cores(tmp_path)
    with Running(["--slots", "core", "--declared", str(declared), "--bind", "127.0.0.1:0"]) as sup:
        st = sup.wait_for(lambda st: len(st["slots"]) == 2 and all(s["binding_verified"] is True
                                                                   for s in st["slots"]), 30, "2 slots verified")
        slots = sorted(st["slots"], key=lambda s: s["slot"])
        assert [s["node"] for s in slots] == [0, 0]
        assert [s["cpus"] for s in slots] == [[cpus[0]], [cpus[1]]]
        assert all(s["mempolicy"] == "bind" and s["memory_nodes"] == [0] for s in slots)
        for s in slots:  # every thread of each worker on its own core
            for task in Path(f"/proc/{s['pid']}/task").iterdir():
                line = [x for x in (task / "status").read_text().splitlines() if x.startswith("Cpus_allowed_list")]
                assert line[0].split()[1] == str(s["cpus"][0])
        seen: set[int] = set()
        for _ in range(200):
            status, body = http_get(sup.port, "/")
            assert status == 200
            seen.add(json.loads(body)["slot"])
            if seen == {0, 1}:
                break
        assert seen == {0, 1}, "each core's slot should serve"
