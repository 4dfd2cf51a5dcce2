"""Warm templates on a real 2-node kernel (runs inside the lab VM only).

``numaserve start --nodes all --workers-per-node 2 --preload warm_app:load``: the
node-1 template allocates 200 MB in its preload hook.  Every node-1 worker is
forked from it and, seen from outside: every thread pinned to its own slot's
CPUs, memory policy bind=static:1, and the 200 MB it shares with the template
backed by node-1 pages (>= 95 %).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from numaserve.bind.verify import check_placement, read_placement
from tests.vm.guestkit import ops_status

HERE = str(Path(__file__).resolve().parent)
REPO = str(Path(__file__).resolve().parents[3])
MB = 200


def _big_anon_pages(pid: int, min_pages: int) -> list[dict[str, int]]:
    """Per large anonymous mapping: its pages per node (N0=, N1= ... of numa_maps)."""
    out = []
    with open(f"/proc/{pid}/numa_maps") as f:
        for line in f:
            m = re.search(r"\banon=(\d+)", line)
            if m and int(m.group(1)) >= min_pages:
                out.append({n: int(c) for n, c in re.findall(r"\bN(\d+)=(\d+)", line)})
    return out


def _rollup(pid: int) -> dict[str, int]:
    kb = {}
    for line in open(f"/proc/{pid}/smaps_rollup"):
        p = line.split()
        if len(p) >= 2 and p[1].isdigit():
            kb[p[0].rstrip(":")] = int(p[1])
    return kb


def test_node1_workers_forked_from_a_node1_template_share_its_200mb_on_n1(node_cpus) -> None:
    base = tempfile.mkdtemp(prefix="ns-warm-")
    rt = base + "/rt"
    cfg = Path(base) / "c.toml"
    cfg.write_text("[supervisor]\nready_timeout = 240.0\nheartbeat_timeout = 60.0\nheartbeat_interval = 1.0\n"
                   "verify_interval = 5.0\n[worker]\nstart = \"fork\"\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "numaserve", "start", "--config", str(cfg), "--runtime-dir", rt, "--nodes", "all",
         "--workers-per-node", "2", "--app", "warm_app:app", "--preload", "warm_app:load", "--app-dir", HERE,
         "--bind", "127.0.0.1:0"],
        stdout=subprocess.DEVNULL, stderr=open(Path(base) / "stderr", "w"), text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)})
    try:
        deadline = time.monotonic() + 400
        st = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, (Path(base) / "stderr").read_text()[-4000:]
            st = ops_status(rt)
            if st and st["slots"] and all(s["state"] == "ready" and s["binding_verified"] for s in st["slots"]):
                break
            time.sleep(1)
        assert st is not None, "supervisor never answered"
        tmpl = {t["node"]: t for t in st["templates"]["nodes"]}
        assert set(tmpl) == {0, 1} and all(t["state"] == "ready" for t in tmpl.values()), tmpl
        t1 = tmpl[1]
        assert t1["cpus"] == list(node_cpus[1]) and t1["memory_nodes"] == [1], t1
        # the template itself: bound to node 1, the 200 MB on node 1
        tobs = read_placement(t1["pid"])
        ok, problems = check_placement(tobs, cpus=list(node_cpus[1]), mempolicy="bind", nodes=[1], require_static=True)
        assert ok, problems
        # forked from node 1's zygote, which is bound the same way (the template inherited it)
        z1 = t1["zygote"]
        assert t1["started_by"] == "zygote" and z1["state"] == "ready" and z1["pid"] != t1["pid"], t1
        ok, problems = check_placement(read_placement(z1["pid"]), cpus=list(node_cpus[1]), mempolicy="bind",
                                       nodes=[1], require_static=True)
        assert ok, problems
        workers = [s for s in st["slots"] if s["node"] == 1]
        assert len(workers) == 2, st["slots"]
        n1_cpus = set(node_cpus[1])
        for s in workers:
            assert s["start"]["mode"] == "fork" and s["start"]["template_pid"] == t1["pid"], s["start"]
            assert s["binding_verified"] is True, s["binding_problems"]
            pid, cpus = s["pid"], set(s["cpus"])
            assert cpus < n1_cpus or cpus == n1_cpus, (cpus, n1_cpus)
            obs = read_placement(pid)
            # every thread (uvicorn's, ZeroMQ's I/O thread ...) on its own slot's CPUs, not the template's
            assert obs.threads and all(set(t.cpus) == cpus for t in obs.threads), (s["slot"], obs.threads)
            ok, problems = check_placement(obs, cpus=sorted(cpus), mempolicy="bind", nodes=[1], require_static=True)
            assert ok, problems
            assert all(t.policy in (None, "bind=static:1") for t in obs.threads), obs.threads
            big = _big_anon_pages(pid, int(MB * 256 * 0.9))
            assert big, f"no {MB} MB anonymous mapping in worker {pid}"
            pages = {k: sum(b.get(k, 0) for b in big) for k in {k for b in big for k in b}}
            total = sum(pages.values())
            assert total >= MB * 256 * 0.9 and pages.get("1", 0) >= 0.95 * total, pages
            roll = _rollup(pid)
            # shared with the template, not copied: most of it counts as shared, PSS well under RSS
            assert roll["Shared_Clean"] + roll["Shared_Dirty"] >= MB * 1024 * 0.9, roll
            assert roll["Pss"] < roll["Rss"] - MB * 1024 * 0.3, roll
        # the node-0 workers came from the node-0 template, bound to node 0
        for s in (s for s in st["slots"] if s["node"] == 0):
            assert s["start"]["template_pid"] == tmpl[0]["pid"] and s["binding_verified"] is True, s
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
