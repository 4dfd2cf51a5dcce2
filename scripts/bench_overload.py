#!/usr/bin/env python3
"""Issue 10: overload comparison, numaserve vs `uvicorn --workers 2` vs
`gunicorn -k uvicorn.workers.UvicornWorker -w 2`, same app, same machine.

2 workers, 20 ms of CPU per request, Poisson arrivals at 1x, 2x and 3x the
measured capacity, 2 s client timeout; per level: goodput, SLO goodput
(2xx within max(10 x unloaded p50, 500 ms)), p99 of admitted requests, shed
rate and shed latency, timeouts, and the CPU-seconds the server burns after
the clients stop.  Writes overload.md and overload.json (default into
docs/benchmarks/) and prints the table with the issue's targets.

    python scripts/bench_overload.py [--reps 3] [--quick] [--out DIR] [--deadline-header]

The same scenario runs inside `scripts/bench` (full mode); this entry point
runs only it.  Bounded: about 4 minutes per repetition in full mode.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

from benchlib import env, report, servers  # noqa: E402
from benchlib.common import Ctx  # noqa: E402
from benchlib.scen_overload import OverloadParams, quick_params, run  # noqa: E402


def _on_term(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)   # unwinds through every server's finally


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="2x only, short runs")
    ap.add_argument("--out", type=Path, default=env.DOCS)
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals per level (default 10)")
    ap.add_argument("--cooperative-only", action="store_true", help="skip the blocking-handler variant")
    ap.add_argument("--deadline-header", action="store_true",
                    help="send x-request-timeout with the client timeout (numaserve uses it; peers ignore it)")
    ap.add_argument("--no-install", action="store_true")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, _on_term)
    peers = env.ensure_peers(install=not a.no_install)
    p = quick_params() if a.quick else OverloadParams()
    if a.duration:
        p.duration_s = a.duration
    if a.cooperative_only:
        p.shapes = {"cooperative": p.shapes.get("cooperative", (1.0, 2.0, 3.0))}
    p.deadline_header = a.deadline_header
    a.out.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(quick=a.quick, reps=a.reps or (1 if a.quick else 3), out=a.out)
    meta = {"quick": a.quick, "reps": ctx.reps, "machine": env.machine_info(), "peers": peers}
    try:
        scen = run(ctx, p)
    finally:
        servers.stop_all()
    meta["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    meta["elapsed_s"] = round(time.monotonic() - ctx.t0, 1)
    report.write_json({"meta": meta, "scenarios": {"overload": scen}}, a.out / "overload.json")
    report.write_overload_md(scen, meta, a.out / "overload.md")
    print((a.out / "overload.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
