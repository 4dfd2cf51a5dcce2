#!/usr/bin/env python3
"""What the locality watch costs: one sample per worker (numa_maps + every thread's stat).

Starts N worker-like processes (a Python interpreter with a touched buffer of
--rss-mb MiB and a few threads), samples each of them --rounds times with
``numaserve.bind.locality.sample_locality`` (what the supervisor runs), and
prints per worker count: the CPU time of one sample (median), of one round
over every worker, the interval the watch settles on for the 1 % budget
(``loops.locality.interval_for`` at the default 10 s) and the CPU share that
gives.  ``--per-mb`` also prints the cost of one sample by RSS (the kernel
walks the page tables to print numa_maps), for the per-MB figure.

    python3 scripts/bench_locality.py                       # 1, 8, 32 workers of 48 MiB
    python3 scripts/bench_locality.py --workers 32 --rss-mb 256 --rounds 5
    python3 scripts/bench_locality.py --per-mb 16,64,256
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numaserve.bind.locality import sample_locality  # noqa: E402
from numaserve.loops.locality import interval_for  # noqa: E402
from numaserve.supervisor.localitywatch import CPU_BUDGET  # noqa: E402

CHILD = """
import sys, threading
b = bytearray({mb} << 20)
for i in range(0, len(b), 4096):
    b[i] = 1
for _ in range(4):
    threading.Thread(target=sys.stdin.read, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


def start(n: int, mb: int) -> list[subprocess.Popen[str]]:
    procs = [subprocess.Popen([sys.executable, "-c", CHILD.format(mb=mb)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(n)]
    for p in procs:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return procs


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def node_view() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This machine's first node and its CPUs (every CPU when sysfs says nothing)."""
    try:
        cpus = Path("/sys/devices/system/node/node0/cpulist").read_text()
        from numaserve.cpulist import parse_list

        return (0,), parse_list(cpus)
    except OSError:
        return (0,), tuple(range(os.cpu_count() or 1))


def measure(procs: list[subprocess.Popen[str]], rounds: int) -> tuple[list[float], list[float], float]:
    """Per-sample CPU costs, per-round CPU costs and the mean resident MiB of a worker."""
    nodes, cpus = node_view()
    samples: list[float] = []
    per_round: list[float] = []
    resident = []
    for _ in range(rounds):
        total = 0.0
        for p in procs:
            s = sample_locality(p.pid, nodes, cpus)
            samples.append(s.cost_s)
            total += s.cost_s
            resident.append(s.total_bytes / 1048576)
        per_round.append(total)
        time.sleep(0.05)
    return samples, per_round, statistics.fmean(resident)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,8,32", help="worker counts, comma-separated")
    ap.add_argument("--rss-mb", type=int, default=48, help="buffer each worker touches (MiB)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--interval", type=float, default=10.0, help="placement.locality_interval")
    ap.add_argument("--per-mb", default="", help="RSS sizes (MiB) for the per-MB cost, e.g. 16,64,256")
    a = ap.parse_args()
    print(f"| workers | RSS/worker | one sample (median) | one round | interval (1 % budget) | CPU share |")
    print("|---|---|---|---|---|---|")
    for n in [int(x) for x in a.workers.split(",") if x]:
        procs = start(n, a.rss_mb)
        try:
            samples, rounds, mib = measure(procs, a.rounds)
        finally:
            stop(procs)
        one = statistics.median(samples)
        rnd = statistics.median(rounds)
        interval = interval_for(a.interval, one, n, CPU_BUDGET)
        print(f"| {n} | {mib:.0f} MiB | {one * 1e3:.2f} ms | {rnd * 1e3:.1f} ms | {interval:.1f} s "
              f"| {rnd / interval * 100:.3f} % |")
    if a.per_mb:
        print("\n| RSS | one sample (median) | per 100 MiB |")
        print("|---|---|---|")
        for mb in [int(x) for x in a.per_mb.split(",") if x]:
            procs = start(1, mb)
            try:
                samples, _, mib = measure(procs, a.rounds)
            finally:
                stop(procs)
            one = statistics.median(samples)
            print(f"| {mib:.0f} MiB | {one * 1e3:.2f} ms | {one * 1e3 / mib * 100:.2f} ms |")


if __name__ == "__main__":
    main()
