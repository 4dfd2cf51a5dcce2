#!/usr/bin/env python3
"""SSE chunk CPU, live, against uvicorn: the diagnostic behind issue 18's last row (§ 1b).

    scripts/bench_sse.py [--servers numaserve,numaserve-noadmission,uvicorn] [--reps 5] [--seconds 5]

Each server runs one worker with its whole tree on CPU 1; ``wrk -t1 -c16``
on CPU 0 streams ``/sse100`` (100 events per response, chunked,
``scripts/bench_apps/benchapp.py``).  Per repetition, a fresh server, the
server order reversed every other repetition; measured is the *worker
process's* CPU per chunk (and the whole tree's), context switches per
request and the stream rate.  The worker is CPU-bound here, so CPU per
chunk is 1 ÷ the chunk rate and single repetitions swing with the host:
read the best and the median over several.  Variants besides the
``scripts/bench`` ones: ``numaserve-noadmission`` (``[admission] enabled =
false``) and ``numaserve-nosentinel`` (``[admission] sentinel = false``),
to A/B what the admission layer costs per chunk.  Needs ``wrk`` and CPUs 0
and 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))   # numaserve from this checkout

from benchlib import procs  # noqa: E402
from benchlib import scen_hotpath as hotpath  # noqa: E402
from benchlib import servers  # noqa: E402
from benchlib.servers import Server, ServerConfig  # noqa: E402

CHUNKS = hotpath.SSE_CHUNKS
servers.VARIANTS.setdefault("numaserve-noadmission",
                            ("numaserve", {"numaserve_toml": "\n[admission]\nenabled = false\n"}))
servers.VARIANTS.setdefault("numaserve-nosentinel",
                            ("numaserve", {"numaserve_toml": "\n[admission]\nsentinel = false\n"}))


def _worker_counters(proc: psutil.Process) -> tuple[float, int, int]:
    """(CPU seconds, voluntary, involuntary context switches) of one process."""
    with proc.oneshot():
        t, c = proc.cpu_times(), proc.num_ctx_switches()
    return t.user + t.system, c.voluntary, c.involuntary


def one(kind: str, seconds: float) -> dict[str, Any]:
    """One fresh server, warmed up, then ``seconds`` of streams."""
    with Server(ServerConfig(kind, workers=1, cpus=(1,))).start() as srv:
        srv.wait_ready()
        hotpath._load(srv, "/", 1.0, {0}, 16)
        hotpath._load(srv, "/sse100", 1.0, {0}, 16)
        worker = psutil.Process(srv.worker_pids()[0])
        tree = procs.TreeCpu(srv.master_pid).start()
        a = _worker_counters(worker)
        n, dur, bad = hotpath._load(srv, "/sse100", seconds, {0}, 16)
        b = _worker_counters(worker)
        tree_cpu = tree.sample()
    chunks = max(1, n * CHUNKS)
    return {"server": kind, "streams_per_s": round(n / dur, 1) if dur else 0.0, "failed": bad,
            "worker_us_per_chunk": round((b[0] - a[0]) / chunks * 1e6, 3),
            "tree_us_per_chunk": round(tree_cpu / chunks * 1e6, 3),
            "voluntary_cs_per_req": round((b[1] - a[1]) / max(1, n), 3),
            "involuntary_cs_per_req": round((b[2] - a[2]) / max(1, n), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="numaserve,uvicorn", help="comma-separated kinds or variants")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args(argv)
    kinds = [k.strip() for k in a.servers.split(",") if k.strip()]
    if a.reps < 1 or a.seconds <= 0 or not kinds:
        ap.error("--reps must be >= 1, --seconds > 0, --servers not empty")
    if not shutil.which("wrk"):
        ap.error("wrk is not installed (apt-get install wrk)")
    if not {0, 1} <= set(os.sched_getaffinity(0)):
        ap.error("needs CPUs 0 and 1 (the worker on 1, wrk on 0)")
    rows: list[dict[str, Any]] = []
    try:
        for rep in range(a.reps):
            for kind in (kinds if rep % 2 == 0 else kinds[::-1]):
                row = {"rep": rep + 1, **one(kind, a.seconds)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        servers.stop_all()
    best: dict[str, float] = {}
    for kind in kinds:
        vals = [r["worker_us_per_chunk"] for r in rows if r["server"] == kind]
        best[kind] = min(vals)
        print(f"{kind:24} worker CPU µs/chunk best {min(vals):.3f} median {statistics.median(vals):.3f}")
    base = best.get("uvicorn")
    if base:
        for kind in kinds:
            if kind != "uvicorn":
                print(f"{kind:24} ÷ uvicorn, best to best: {best[kind] / base:.3f}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
