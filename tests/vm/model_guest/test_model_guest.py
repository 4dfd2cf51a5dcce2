"""The reference model app on a real 2-node kernel (runs inside the lab VM only).

``numaserve model init`` (64 MB), then ``numaserve start --nodes all --workers-per-node 2
--app numaserve.apps.model:app --preload numaserve.apps.model:load``: each node's
template loads its own copy of the weights, and numa_maps shows that copy's
anonymous pages on the template's node (>= 95 %); the node's workers, forked from
it, map the same pages (shared, on that node) and answer completions.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from tests.vm.guestkit import ops_status

REPO = str(Path(__file__).resolve().parents[3])
SIZE = "64MB"


def _anon_pages(pid: int, min_pages: int) -> tuple[dict[str, int], list[str]]:
    """Pages per node of the anonymous mappings of at least ``min_pages``, and their policies."""
    pages: dict[str, int] = {}
    policies = []
    with open(f"/proc/{pid}/numa_maps") as f:
        for line in f:
            m = re.search(r"\banon=(\d+)", line)
            if m and int(m.group(1)) >= min_pages and " file=" not in line:
                policies.append(line.split()[1])
                for node, count in re.findall(r"\bN(\d+)=(\d+)", line):
                    pages[node] = pages.get(node, 0) + int(count)
    return pages, policies


def _rollup(pid: int) -> dict[str, int]:
    kb = {}
    for line in open(f"/proc/{pid}/smaps_rollup"):
        p = line.split()
        if len(p) >= 2 and p[1].isdigit():
            kb[p[0].rstrip(":")] = int(p[1])
    return kb


def test_each_template_holds_its_weights_on_its_node_and_its_workers_share_them(node_cpus) -> None:
    base = tempfile.mkdtemp(prefix="ns-model-")
    weights = Path(base) / "ref.safetensors"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
           "NUMASERVE_MODEL": str(weights)}
    r = subprocess.run([sys.executable, "-m", "numaserve", "model", "init", str(weights), "--size", SIZE],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    weight_pages = weights.stat().st_size // 4096
    rt = base + "/rt"
    cfg = Path(base) / "c.toml"
    cfg.write_text("[supervisor]\nready_timeout = 400.0\nheartbeat_timeout = 60.0\nheartbeat_interval = 1.0\n"
                   "verify_interval = 5.0\n[worker]\nstart = \"fork\"\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "numaserve", "start", "--config", str(cfg), "--runtime-dir", rt, "--nodes", "all",
         "--workers-per-node", "2", "--app", "numaserve.apps.model:app", "--preload", "numaserve.apps.model:load",
         "--bind", "127.0.0.1:0"],
        stdout=subprocess.DEVNULL, stderr=open(Path(base) / "stderr", "w"), text=True, env=env)
    try:
        deadline = time.monotonic() + 500
        st = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, (Path(base) / "stderr").read_text()[-4000:]
            st = ops_status(rt)
            if st and st["slots"] and all(s["state"] == "ready" and s["binding_verified"] for s in st["slots"]):
                break
            time.sleep(1)
        assert st is not None and all(s["state"] == "ready" for s in st["slots"]), st
        tmpl = {t["node"]: t for t in st["templates"]["nodes"]}
        assert set(tmpl) == {0, 1} and all(t["state"] == "ready" for t in tmpl.values()), tmpl
        for node, t in tmpl.items():
            pages, policies = _anon_pages(t["pid"], 256)
            total = sum(pages.values())
            # the weights (and the interpreter's own heap) on the template's node, under its bind policy
            assert pages.get(str(node), 0) >= 0.8 * weight_pages, (node, pages, weight_pages)
            assert pages.get(str(node), 0) >= 0.95 * total, (node, pages)
            assert policies and all(p.startswith("bind") for p in policies), policies
            assert str(weights) not in Path(f"/proc/{t['pid']}/maps").read_text()
            for s in (s for s in st["slots"] if s["node"] == node):
                assert s["start"]["mode"] == "fork" and s["start"]["template_pid"] == t["pid"], s["start"]
                wpages, _ = _anon_pages(s["pid"], 256)
                assert wpages.get(str(node), 0) >= 0.8 * weight_pages, (s["slot"], wpages)
                roll = _rollup(s["pid"])
                assert roll["Shared_Clean"] + roll["Shared_Dirty"] >= 0.9 * weight_pages * 4, roll
        port = int(st["supervisor"]["listeners"][0].rsplit(":", 1)[1])
        for _ in range(4):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "the node", "max_tokens": 4}).encode(),
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
