#!/usr/bin/env python3
"""Many workers on few CPUs: numaserve vs gunicorn + UvicornWorker, side by side (docs/benchmarks.md § 1b).

    flock /tmp/numaserve-heavy.lock scripts/bench_crowd.py                        # this tree vs gunicorn, 2 rounds
    flock /tmp/numaserve-heavy.lock scripts/bench_crowd.py --baseline ../base     # + another numaserve tree
    flock /tmp/numaserve-heavy.lock scripts/bench_crowd.py --variant 'no-admission=[admission]\\nenabled = false'

Each server starts with ``--workers-per-node W`` / ``-w W`` (32 by default)
on the machine's CPUs, every default on, serving ``scripts/bench_apps``'
tiny endpoint; after every worker is ready, 1 s of warm-up (16 connections,
closed again), then ``wrk -t2 -c64`` for ``--seconds``.  Per server:

- requests per second (wrk) and its ratio to gunicorn's in the same round;
- worker CPU per request: user+system of the server tree over the window
  (``psutil``), divided by the requests answered;
- busy workers: workers that used more than a quarter of the busiest one's
  CPU in the window; the share of the work the busiest 8 did;
- context switches (voluntary + involuntary, whole tree) per request.

Rounds alternate the servers' order so each pair shares the machine's load.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))   # numaserve from this checkout

import psutil  # noqa: E402

from benchlib.scen_hotpath import _load  # noqa: E402
from benchlib.servers import Server, ServerConfig  # noqa: E402


def _tree(root: int) -> list[psutil.Process]:
    try:
        p = psutil.Process(root)
        return [p, *p.children(recursive=True)]
    except psutil.Error:
        return []


def _sample(procs: list[psutil.Process]) -> dict[int, tuple[float, int]]:
    """pid -> (CPU seconds, context switches) of each live process."""
    out = {}
    for p in procs:
        try:
            with p.oneshot():
                t, c = p.cpu_times(), p.num_ctx_switches()
        except psutil.Error:
            continue
        out[p.pid] = (t.user + t.system, c.voluntary + c.involuntary)
    return out


def measure(cfg: ServerConfig, seconds: float) -> dict[str, Any]:
    """One start of ``cfg``: warm-up, then wrk for ``seconds``; the row for the table."""
    with Server(cfg).start() as srv:
        srv.wait_ready(timeout=300.0)
        _load(srv, "/", 1.0, None, 16)
        workers = set(srv.worker_pids())
        procs = _tree(srv.master_pid)
        a = _sample(procs)
        n, dur, bad = _load(srv, "/", seconds, None, 64)
        b = _sample(procs)
        hot = None
        if cfg.kind == "numaserve":   # which slots took the connections, and their CPUs
            st = srv.ops("status")
            hs = (st.get("supervisor", {}).get("steering") or {}).get("hot_set")
            cpus = {s["slot"]: s.get("cpus") for s in st.get("slots", [])}
            hot = None if hs is None else {str(s): cpus.get(s) for s in hs["slots"]}
    cpu = {pid: b[pid][0] - a[pid][0] for pid in b if pid in a}
    cs = sum(b[pid][1] - a[pid][1] for pid in b if pid in a)
    per_worker = sorted((cpu.get(pid, 0.0) for pid in workers), reverse=True)
    top = per_worker[0] if per_worker else 0.0
    total_w = sum(per_worker)
    return {
        "server": cfg.name, "rps": round(n / dur, 1) if dur else 0.0, "failed": bad,
        "worker_cpu_us_per_req": round(total_w / n * 1e6, 1) if n else None,
        "tree_cpu_us_per_req": round(sum(cpu.values()) / n * 1e6, 1) if n else None,
        "busy_workers": sum(1 for c in per_worker if top and c > top / 4.0), "workers": len(workers),
        "top8_share": round(sum(per_worker[:8]) / total_w, 3) if total_w else None,
        "cs_per_req": round(cs / n, 3) if n else None,
        "hot_set": hot,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", default="", help="another numaserve source tree, run as 'numaserve-base'")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=TOML: this tree with TOML appended to its config ('\\n' for newlines)")
    ap.add_argument("--no-gunicorn", action="store_true")
    ap.add_argument("--json", default="", help="write the rows here")
    args = ap.parse_args()
    if not shutil.which("wrk"):
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    cfgs = [ServerConfig("numaserve", workers=args.workers)]
    if args.baseline:
        cfgs.append(ServerConfig("numaserve", workers=args.workers, label="numaserve-base",
                                 checkout=str(Path(args.baseline).resolve())))
    for v in args.variant:
        name, _, toml = v.partition("=")
        cfgs.append(ServerConfig("numaserve", workers=args.workers, label=name,
                                 numaserve_toml="\n" + toml.replace("\\n", "\n") + "\n"))
    if not args.no_gunicorn:
        cfgs.append(ServerConfig("gunicorn", workers=args.workers))
    rows = []
    print(f"{args.workers} workers, wrk -t2 -c64 {args.seconds:g} s, load average {psutil.getloadavg()[0]:.1f}")
    for r in range(args.rounds):
        order = cfgs if r % 2 == 0 else cfgs[::-1]
        got = {}
        for cfg in order:
            row = measure(cfg, args.seconds)
            row["round"] = r + 1
            got[cfg.name] = row
            rows.append(row)
            time.sleep(0.5)
        g = got.get("gunicorn", {}).get("rps")
        for name, row in got.items():
            row["vs_gunicorn"] = round(row["rps"] / g, 3) if g else None
            print(f"round {r + 1} {name:16} {row['rps']:9.0f} req/s  x{row['vs_gunicorn']}  "
                  f"{row['worker_cpu_us_per_req']} µs/req  busy {row['busy_workers']}/{row['workers']}  "
                  f"top8 {row['top8_share']}  cs/req {row['cs_per_req']}  failed {row['failed']}"
                  + (f"  hot {row['hot_set']}" if row.get("hot_set") else ""), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
