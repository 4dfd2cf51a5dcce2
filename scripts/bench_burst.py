#!/usr/bin/env python3
"""The start of an overload: latency tails of admitted requests and of 503s (issue 13, § 2a).

    flock /tmp/numaserve-heavy.lock scripts/bench_burst.py [--baseline CHECKOUT] [--reps 2]

numaserve with ``scripts/bench_apps/benchapp.py``, 2 workers, default config.
Per run a **fresh server**: a short warm-up, the unloaded p50 (one client),
then an open loop (Poisson) at ``--levels`` × the capacity for ``--duration``
seconds on ``/cpu20y`` (cooperative, yields every 5 ms) and ``/cpu20``
(one blocking 20 ms call), then the CPU the server still burns (≤ 3 s).  The
capacity C is measured once (closed loop, 8 clients) on the first variant.
Per run: shed share, p50/p99 of 2xx and of 503, the share of 503 under 10 ms,
timeouts.  ``--baseline`` runs another checkout (e.g. the main worktree) in
the same run, interleaved, as the ratio's baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))   # numaserve from this checkout

from benchlib import engine, procs
from benchlib.scen_overload import PATHS, OverloadParams, start_server
from benchlib.servers import Server, stop_all

import numaserve.tools.loadtest as lt

def _start(checkout: str) -> Server:
    return start_server("numaserve", OverloadParams(workers=2), checkout)


def capacity(checkout: str, seconds: float = 4.0) -> float:
    with _start(checkout) as srv:
        engine.run(lt.LoadConfig(srv.url + PATHS["cooperative"], concurrency=4, duration=1.0, timeout=10.0))
        r = engine.run(lt.LoadConfig(srv.url + PATHS["cooperative"], concurrency=8, duration=seconds, timeout=10.0))
        return r.ok / r.result.duration_s


def one(checkout: str, shape: str, rate: float, duration: float, timeout: float) -> dict[str, Any]:
    path = PATHS[shape]
    with _start(checkout) as srv:
        engine.run(lt.LoadConfig(srv.url + path, concurrency=4, duration=0.5, timeout=10.0))
        u = engine.run(lt.LoadConfig(srv.url + path, concurrency=1, duration=2.0, timeout=10.0)).summary("2xx")
        r = engine.run(lt.LoadConfig(srv.url + path, rate=rate, duration=duration, timeout=timeout,
                                     connections=1000))
        after = procs.cpu_over(srv.master_pid, 3.0, stop_after_idle_s=1.0)
    sent = r.result.requests + r.result.error_count
    ok = r.summary("2xx") or {}
    shed = r.summary("503") or {}
    return {
        "unloaded_p50_ms": u["p50"] if u else None,
        "sent": sent,
        "p50_2xx_ms": ok.get("p50"), "p99_2xx_ms": ok.get("p99"),
        "shed_frac": round(r.count("503") / sent, 3) if sent else None,
        "p50_503_ms": shed.get("p50"), "p99_503_ms": shed.get("p99"),
        "under_10ms_503": r.fraction_under("503", 0.010),
        "timeouts": r.result.errors["timeout"],
        "cpu_after_s": after["cpu_s"],
        "slo_goodput_rps": round(r.within("2xx", 0.5) / duration, 1),
    }


def _fmt(x: Any) -> str:
    if x is None:
        return "–"
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="", help="another checkout to run as the baseline (same run)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--levels", default="1,2", help="comma-separated multiples of the capacity")
    ap.add_argument("--shapes", default="cooperative,blocking")
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--capacity", type=float, default=0.0, help="skip the capacity run: C in req/s")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    here = str(HERE.parent)
    variants = [("this", here)] + ([("baseline", a.baseline)] if a.baseline else [])
    levels = [float(x) for x in a.levels.split(",")]
    shapes = a.shapes.split(",")
    rows: list[dict[str, Any]] = []
    try:
        C = a.capacity or capacity(variants[-1][1])
        print(f"capacity C = {C:.1f} req/s; load average {os.getloadavg()[0]:.2f}", flush=True)
        for rep in range(a.reps):
            for shape in shapes:
                for level in levels:
                    order = variants if rep % 2 == 0 else variants[::-1]
                    for name, co in order:
                        row = {"variant": name, "shape": shape, "level": level, "rep": rep + 1,
                               **one(co, shape, level * C, a.duration, a.timeout)}
                        rows.append(row)
                        print(" ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
    finally:
        stop_all()
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    if a.json:
        a.json.write_text(json.dumps({"capacity_rps": C, "rows": rows, "at": time.time()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
