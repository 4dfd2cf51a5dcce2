"""`numaserve start --nodes all` on a real 2-node kernel (runs inside the lab VM only).

The node-1 worker's threads must all be on node 1's CPUs, its memory policy
bound to node 1, and a 200 MB allocation inside it must land >= 95 % on node 1.
With --steering numa, a client pinned to a node-1 CPU is served by that worker.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from numaserve.bind.verify import check_placement, read_placement
from tests.vm.guestkit import ops_status

APPS = str(Path(__file__).resolve().parent / "apps")


def _get(port: int, path: str, cpu: int) -> dict:
    out: dict = {}

    def run() -> None:
        os.sched_setaffinity(0, {cpu})
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            c.request("GET", path, headers={"Connection": "close"})
            out.update(json.loads(c.getresponse().read()))
        finally:
            c.close()

    t = threading.Thread(target=run)
    t.start()
    t.join(180)
    return out


def test_supervisor_binds_node1_worker_and_its_memory(node_cpus) -> None:
    rt = tempfile.mkdtemp(prefix="ns-vm-")
    cfg = Path(rt) / "c.toml"
    cfg.write_text("[supervisor]\nready_timeout = 240.0\nheartbeat_timeout = 60.0\nheartbeat_interval = 1.0\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "numaserve", "start", "--config", str(cfg), "--runtime-dir", rt + "/rt",
         "--nodes", "all", "--app", "vmalloc_app:app", "--app-dir", APPS, "--steering", "numa",
         "--bind", "127.0.0.1:0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 300
        st = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            got = ops_status(rt + "/rt")
            if got is not None:
                st = got
                if st["slots"] and all(s["state"] == "ready" and s["binding_verified"] for s in st["slots"]):
                    break
            time.sleep(1)
        assert st is not None, "supervisor never answered"
        slots = {s["node"]: s for s in st["slots"]}
        assert set(slots) == {0, 1}, st["slots"]
        s1 = slots[1]
        assert s1["state"] == "ready" and s1["binding_verified"] is True, s1
        n1 = set(node_cpus[1])
        # from outside: every thread on node 1's CPUs, policy bind=static:1
        obs = read_placement(s1["pid"])
        assert obs.threads and all(set(t.cpus) <= n1 for t in obs.threads), obs.threads
        ok, problems = check_placement(obs, cpus=sorted(n1), mempolicy="bind", nodes=[1], require_static=True)
        assert ok, problems
        assert all(t.policy in (None, "bind=static:1") for t in obs.threads), obs.threads
        # a client on a node-1 CPU reaches the node-1 worker (numa steering), which allocates 200 MB
        port = int(st["supervisor"]["listeners"][0].rsplit(":", 1)[1])
        reply = _get(port, "/alloc?mb=200", max(n1))
        assert reply["node"] == 1 and reply["pid"] == s1["pid"], reply
        pages = reply["big_vma_pages"]
        total = sum(pages.values())
        assert total >= reply["want_pages"] * 0.9, reply
        assert pages.get("1", 0) >= 0.95 * total, reply
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
