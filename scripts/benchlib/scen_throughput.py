"""Scenario 1: closed-loop throughput and latency percentiles.

Two requests: a tiny response (``/``, per-request overhead) and ~5 ms of CPU
(``/cpu5``).  Two placements:

- *shared*: N=2 workers and the load generator all on the machine's 2 CPUs,
  unpinned (numaserve pins its workers one per CPU, as it does by default);
- *pinned*: 1 worker with the whole server tree on CPU 1 and the generator
  thread on CPU 0.  On a 2-CPU machine this is the only way to keep the
  generator off the workers' CPUs, and it costs a worker: the numbers are per
  single worker, not the machine's capacity.

Besides client-side rate and latency, the server tree's CPU time per request
is recorded: it is less sensitive than the rate to what else the shared
machine is doing.
"""

from __future__ import annotations

import os
from typing import Any

import numaserve.tools.loadtest as lt

from benchlib import engine, procs
from benchlib.common import Ctx, summarize_rows
from benchlib.servers import Server, ServerConfig

KEYS = ("rps", "p50_ms", "p90_ms", "p99_ms", "p999_ms", "failed", "server_cpu_us_per_req", "client_cpu_pct")

VARIANTS = (
    # name, path, concurrency, placement
    ("tiny", "/", 16, "shared"),
    ("cpu5", "/cpu5", 8, "shared"),
    ("tiny", "/", 16, "pinned"),
    ("cpu5", "/cpu5", 8, "pinned"),
)


def _measure(srv: Server, path: str, conc: int, duration: float, gen_cpus: set[int] | None) -> dict[str, Any]:
    meter = procs.TreeCpu(srv.master_pid).start()
    r = engine.run(lt.LoadConfig(srv.url + path, concurrency=conc, duration=duration, timeout=10.0),
                   cpus=gen_cpus)
    cpu = meter.sample()
    lat = r.summary("2xx") or {}
    return {
        "rps": round(r.ok / r.result.duration_s, 1) if r.result.duration_s else 0.0,
        "p50_ms": lat.get("p50"), "p90_ms": lat.get("p90"), "p99_ms": lat.get("p99"),
        "p999_ms": lat.get("p99.9"),
        "failed": r.failed,
        "server_cpu_us_per_req": round(cpu / r.ok * 1e6, 1) if r.ok else None,
        "client_cpu_pct": r.result.to_dict()["client_cpu_pct"],
    }


def run(ctx: Ctx) -> dict[str, Any]:
    duration = ctx.pick(1.0, 3.0)
    pinned_ok = {0, 1} <= set(os.sched_getaffinity(0))
    raw: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for rep in range(ctx.reps):
        for placement in ("shared", "pinned"):
            if placement == "pinned" and not pinned_ok:
                continue
            for kind in ctx.order(rep):
                cfg = ServerConfig(kind, workers=2 if placement == "shared" else 1,
                                   cpus=(1,) if placement == "pinned" else None)
                gen = {0} if placement == "pinned" else None
                with Server(cfg).start() as srv:
                    srv.wait_ready()
                    engine.run(lt.LoadConfig(srv.url + "/", concurrency=4, duration=ctx.pick(0.3, 0.5)), cpus=gen)  # warm-up
                    for name, path, conc, pl in VARIANTS:
                        if pl != placement:
                            continue
                        row = _measure(srv, path, conc, duration, gen)
                        raw.setdefault((name, placement, kind), []).append(row)
                        ctx.log(f"throughput rep {rep + 1} {placement:6} {name:4} {kind:9} "
                                f"{row['rps']:8.1f} req/s p99 {row['p99_ms']} ms")
    rows = [{"variant": name, "placement": pl, "server": kind, "reps": reps, **summarize_rows(reps, KEYS)}
            for (name, pl, kind), reps in raw.items()]
    return {
        "title": "Throughput and latency (closed loop)",
        "params": {"duration_s": duration, "reps": ctx.reps,
                   "variants": [{"name": n, "path": p, "concurrency": c, "placement": pl} for n, p, c, pl in VARIANTS],
                   "shared": "2 workers; generator and workers share both CPUs",
                   "pinned": "1 worker, server tree on CPU 1, generator thread on CPU 0"
                             + ("" if pinned_ok else " (skipped: CPUs 0 and 1 not both available)")},
        "rows": rows,
    }
