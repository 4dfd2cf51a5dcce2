#!/usr/bin/env python3
"""The supervisor with many idle workers: its CPU, and the ``ratelimit set`` round trip.

    flock /tmp/numaserve-heavy.lock scripts/bench_idle.py                 # 32 workers, 30 s idle, 100 pushes
    flock /tmp/numaserve-heavy.lock scripts/bench_idle.py --profile p.txt # + a py-spy profile of the idle supervisor

One numaserve start with ``--workers-per-node W`` (the 32-worker rows of
docs/benchmarks.md § 1b / § 5), every default on.  Measured on the
supervising process only:

- idle CPU: ``psutil`` user+system delta over the window, after a settling
  pause (spawns and first checks out of it), as a % of one CPU;
- optionally a ``py-spy record`` of the idle supervisor (raw folded stacks)
  over a second window, so the profile does not disturb the number;
- ``ping`` round trip (the ops client's floor: connect, request, reply);
- ``ratelimit set`` round trips: the reply comes once every worker acknowledged
  the new epoch (``benchlib.scen_overhead.control_latency``, which also checks
  that ``ratelimit show`` agrees), paced to stay under the ops rate limit, and
  the supervisor's CPU per push.

To compare two checkouts, run this script from each one in the same lock hold.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))   # numaserve from this checkout

import psutil  # noqa: E402

from benchlib.scen_overhead import control_latency  # noqa: E402
from benchlib.servers import Server, ServerConfig  # noqa: E402


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000.0, 2)


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def run(workers: int, window: float, pushes: int, profile: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"workers": workers, "window_s": window, "pushes": pushes}
    with Server(ServerConfig("numaserve", workers=workers)).start() as srv:
        srv.wait_ready(timeout=300.0)
        time.sleep(5.0)
        p = psutil.Process(srv.master_pid)
        a, t0 = _cpu(p), time.monotonic()
        time.sleep(window)
        used, dt = _cpu(p) - a, time.monotonic() - t0
        out["supervisor_idle_cpu_pct"] = round(100.0 * used / dt, 3)
        if profile:
            if shutil.which("py-spy") is None:
                out["profile"] = "py-spy not installed"
            else:
                subprocess.run(["py-spy", "record", "-r", "200", "-d", str(int(window)), "-f", "raw", "-o", profile,
                                "-p", str(srv.master_pid), "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
                out["profile"] = profile
        pings = []
        for _ in range(pushes):
            t = time.perf_counter()
            srv.ops("ping", {}, timeout=5.0)
            pings.append(time.perf_counter() - t)
            time.sleep(0.03)
        out["ping_p50_ms"], out["ping_p99_ms"] = _pct(pings, 0.5), _pct(pings, 0.99)
        lat: list[float] = []
        failed = 0
        a = _cpu(p)
        for i in range(pushes):
            d, _ = control_latency(srv, 8 + i % 8, workers)
            if d is None:
                failed += 1
            else:
                lat.append(d)
            time.sleep(0.08)   # 3 ops requests per push: stay under the per-client ops rate limit
        out["supervisor_cpu_ms_per_push"] = round((_cpu(p) - a) / pushes * 1000.0, 2)  # incl. 2 ratelimit show
        srv.ops("ratelimit_auto", {}, timeout=10.0)
        out["ratelimit_set_failed"] = failed
        if lat:
            out.update(ratelimit_set_p50_ms=_pct(lat, 0.5), ratelimit_set_p99_ms=_pct(lat, 0.99),
                       ratelimit_set_min_ms=round(min(lat) * 1000.0, 2))
    out["loadavg"] = [round(x, 2) for x in psutil.getloadavg()]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--window", type=float, default=30.0, help="idle window, seconds")
    ap.add_argument("--pushes", type=int, default=100, help="ratelimit set round trips (and pings)")
    ap.add_argument("--profile", help="write a py-spy raw profile of the idle supervisor here")
    args = ap.parse_args()
    print(json.dumps(run(args.workers, args.window, args.pushes, args.profile)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
