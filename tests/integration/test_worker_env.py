"""Per-slot worker environment: thread pools follow the slot's CPUs, for real."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.integration.harness import EXEC_WORKERS, FAST_CONFIG, Running, http_get

pytestmark = pytest.mark.slow


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


def test_thread_pools_and_templated_env_reach_the_worker() -> None:
    pytest.importorskip("numpy")
    pytest.importorskip("threadpoolctl")
    cfg = FAST_CONFIG + '\n[env]\nvars = { SHARD = "s{slot}-n{node}-c{ncpus}" }\n[env.slot."1"]\nONLY_ONE = "yes"\n'
    # /proc/PID/environ is the environment a process was exec'd with: exec'd workers here
    # (a forked worker's own environment is checked from inside in test_template.py)
    cfg += EXEC_WORKERS
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    with Running(["--nodes", "0", "--workers-per-node", "2", "--app", "blasapp:app", "--bind", "127.0.0.1:0"],
                 config=cfg, env=env) as sup:
        slots = sup.slots()
        for s in slots:
            e = environ(s["pid"])
            n = len(s["cpus"])
            for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
                assert e[var] == str(n), (var, e.get(var))
            assert e["SHARD"] == f"s{s['slot']}-n0-c{n}"
            assert e["NUMASERVE_SLOT"] == str(s["slot"]) and e["NUMASERVE_CPUS"]
            assert ("ONLY_ONE" in e) == (s["slot"] == 1)
            assert s["env"]["OMP_NUM_THREADS"] == str(n)      # shown in status
        seen = {}
        for _ in range(40):
            status, body = http_get(sup.port, "/")
            d = json.loads(body)
            seen[d["slot"]] = d
            if len(seen) == 2:
                break
        for slot, d in seen.items():
            n = len(slots[slot]["cpus"])
            assert d["pools"], d
            assert all(p["num_threads"] == n for p in d["pools"]), d


def test_operator_setting_wins() -> None:
    pytest.importorskip("numpy")
    env = {**os.environ, "OMP_NUM_THREADS": "3"}
    with Running(["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0"], env=env) as sup:
        for s in sup.slots():
            assert environ(s["pid"])["OMP_NUM_THREADS"] == "3"
            assert "OMP_NUM_THREADS" not in s["env"]
