"""Scenario 4: load balance across workers, and locality with ``--steering numa``.

Balance: 2 workers, 8 closed-loop clients on ``GET /cpu?ms=1``, once with a
new connection per request and once with keep-alive connections (a kept
connection stays on the worker that accepted it, so how connections are
spread is what decides the balance).  Requests per worker are counted by the
app itself (``BENCH_COUNT_DIR``), so every server is measured the same way.

Locality: numaserve on a *declared* topology mapping this machine's 2 CPUs
onto 2 pretend nodes (node 0 = CPU 0, node 1 = CPU 1), one worker per node,
``--steering numa`` (and ``hash`` for contrast); the peers with 2 workers.
The client is pinned to CPU 0, then CPU 1, opening a new connection per
request.  On loopback the CPU that "receives" a connection is the sender's,
so the share served on the receiving node is the share of requests handled on
the client's CPU (the app records the CPU per request, ``BENCH_COUNT_CPU``).
Caveat: on one machine the worker on the client's CPU shares that CPU with the
client, so locality here costs throughput; with a real NIC the receiving CPU
runs only the softirq.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numaserve.tools.loadtest as lt

from benchlib import engine
from benchlib.common import Ctx, summarize, summarize_rows
from benchlib.servers import Server, ServerConfig

DECLARED = """mode = "replace"
[[node]]
id = 0
cpus = "0"
memory_node = 0
[[node]]
id = 1
cpus = "1"
memory_node = 0
"""

PATH = "/cpu?ms=1"


def read_counts(d: Path) -> dict[int, dict[str, Any]]:
    """Per worker pid: requests and per-CPU counts, as last flushed by the app."""
    out = {}
    for f in d.glob("*.json"):
        try:
            data = json.loads(f.read_text())
            out[int(data["pid"])] = data
        except (ValueError, OSError, KeyError):
            continue
    return out


def _delta(before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out = {}
    for pid, a in after.items():
        b = before.get(pid, {"requests": 0, "cpus": {}})
        cpus = {c: n - b["cpus"].get(c, 0) for c, n in a.get("cpus", {}).items()}
        out[pid] = {"requests": a["requests"] - b["requests"], "cpus": {c: n for c, n in cpus.items() if n}}
    return out


def _settled(d: Path) -> dict[int, dict[str, Any]]:
    time.sleep(0.3)   # the app flushes every 0.2 s
    return read_counts(d)


def balance_run(srv: Server, d: Path, keepalive: bool, duration: float) -> dict[str, Any]:
    before = _settled(d)
    r = engine.run(lt.LoadConfig(srv.url + PATH, concurrency=8, duration=duration, keepalive=keepalive,
                                 timeout=10.0))
    per = _delta(before, _settled(d))
    counts = sorted((v["requests"] for v in per.values() if v["requests"] > 0), reverse=True)
    counts += [0] * max(0, srv.cfg.workers - len(counts))
    total = sum(counts) or 1
    return {
        "rps": round(r.ok / r.result.duration_s, 1) if r.result.duration_s else 0.0,
        "per_worker": counts,
        "busiest_share": round(counts[0] / total, 3),
        "idlest_share": round(counts[-1] / total, 3),
        "failed": r.failed,
    }


def locality_run(srv: Server, d: Path, duration: float) -> dict[str, Any]:
    local = total = 0
    rps = []
    for cpu in (0, 1):
        before = _settled(d)
        r = engine.run(lt.LoadConfig(srv.url + PATH, concurrency=4, duration=duration, keepalive=False,
                                     timeout=10.0), cpus={cpu})
        rps.append(r.ok / r.result.duration_s if r.result.duration_s else 0.0)
        for v in _delta(before, _settled(d)).values():
            total += v["requests"]
            local += v["cpus"].get(str(cpu), 0)
    row: dict[str, Any] = {"local_share": round(local / total, 3) if total else None, "rps": round(sum(rps) / 2, 1)}
    if srv.cfg.kind == "numaserve":
        try:
            steer = srv.ops("status", timeout=2.0)["supervisor"].get("steering") or {}
            row["numaserve_locality_share"] = steer.get("locality_share")
        except Exception:
            pass
    return row


def run(ctx: Ctx) -> dict[str, Any]:
    duration = ctx.pick(1.0, 2.0)
    tmp = Path(tempfile.mkdtemp(prefix="bench-balance-"))
    declared = tmp / "declared.toml"
    declared.write_text(DECLARED)
    bal: dict[tuple[str, str], list[dict[str, Any]]] = {}
    loc: dict[str, list[dict[str, Any]]] = {}
    try:
        for rep in range(ctx.reps):
            for kind in ctx.order(rep):
                d = Path(tempfile.mkdtemp(dir=tmp))
                with Server(ServerConfig(kind, workers=2, env={"BENCH_COUNT_DIR": str(d)})).start() as srv:
                    srv.wait_ready()
                    engine.run(lt.LoadConfig(srv.url + "/", concurrency=2, duration=0.3))
                    for keep in (False, True):
                        row = balance_run(srv, d, keep, duration)
                        variant = "keep-alive" if keep else "new connection per request"
                        bal.setdefault((variant, kind), []).append(row)
                        ctx.log(f"balance rep {rep + 1} {kind:9} {variant:27} per worker {row['per_worker']}")
            loc_servers: list[tuple[str, ServerConfig]] = []
            for kind in ctx.order(rep):
                if kind == "numaserve":
                    for steering in ctx.pick(("numa",), ("numa", "hash")):
                        loc_servers.append((f"numaserve --steering {steering}", ServerConfig(
                            kind, workers=1, label=f"numaserve-{steering}",
                            numaserve_args=("--declared", str(declared), "--nodes", "all", "--steering", steering))))
                else:
                    loc_servers.append((kind, ServerConfig(kind, workers=2)))
            for label, cfg in loc_servers:
                d = Path(tempfile.mkdtemp(dir=tmp))
                cfg.env = {"BENCH_COUNT_DIR": str(d), "BENCH_COUNT_CPU": "1"}
                with Server(cfg).start() as srv:
                    srv.wait_ready()
                    row = locality_run(srv, d, duration)
                    loc.setdefault(label, []).append(row)
                    ctx.log(f"locality rep {rep + 1} {label:26} served on the client's CPU {row['local_share']}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [{"variant": v, "server": k, "reps": reps,
             **summarize_rows(reps, ("busiest_share", "idlest_share", "rps", "failed"))}
            for (v, k), reps in sorted(bal.items())]
    loc_rows = [{"server": k, "reps": reps, "local_share": summarize(r["local_share"] for r in reps),
                 "rps": summarize(r["rps"] for r in reps)} for k, reps in loc.items()]
    return {
        "title": "Load balance and NUMA locality",
        "params": {"duration_s": duration, "path": PATH, "workers": 2, "clients": 8, "reps": ctx.reps,
                   "locality": "declared 2-node topology (CPU 0 / CPU 1), client pinned to each CPU in turn, "
                               "new connection per request, 4 clients"},
        "rows": rows,
        "locality": loc_rows,
    }
