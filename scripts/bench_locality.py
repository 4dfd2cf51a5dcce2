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


def measure(procs: list[subprocess.Popen[str]], rounds: int) -> tuple[list[list[float]], list[float], float]:
    """Per worker its samples' CPU costs, per-round CPU costs and the mean anonymous MiB of a worker."""
    nodes, cpus = node_view()
    costs: list[list[float]] = [[] for _ in procs]
    per_round: list[float] = []
    anon = []
    for _ in range(rounds):
        total = 0.0
        for i, p in enumerate(procs):
            s = sample_locality(p.pid, nodes, cpus)
            costs[i].append(s.cost_s)
            total += s.cost_s
            anon.append(s.total_bytes / 1048576)
        per_round.append(total)
        time.sleep(0.05)
    return costs, per_round, statistics.fmean(anon)


def cpu_share(costs: list[list[float]], base: float) -> tuple[float, float]:
    """(median interval, CPU share) as the watch runs: each worker's next sample is spaced by
    ``interval_for`` of its previous sample's cost, and costs the next sample's."""
    n = len(costs)
    share = 0.0
    intervals = []
    for c in costs:
        steps = [(nxt, interval_for(base, prev, n, CPU_BUDGET)) for prev, nxt in zip(c, c[1:])] or \
                [(c[0], interval_for(base, c[0], n, CPU_BUDGET))]
        share += statistics.fmean(x / iv for x, iv in steps)
        intervals += [iv for _, iv in steps]
    return statistics.median(intervals), share


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,8,32", help="worker counts, comma-separated")
    ap.add_argument("--rss-mb", type=int, default=48, help="buffer each worker touches (MiB)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--interval", type=float, default=10.0, help="placement.locality_interval")
    ap.add_argument("--per-mb", default="", help="RSS sizes (MiB) for the per-MB cost, e.g. 16,64,256")
    a = ap.parse_args()
    print("| workers | anon memory/worker | one sample (median) | one round (median) | interval (median) "
          "| CPU share |")
    print("|---|---|---|---|---|---|")
    for n in [int(x) for x in a.workers.split(",") if x]:
        procs = start(n, a.rss_mb)
        try:
            samples, rounds, mib = measure(procs, a.rounds)
        finally:
            stop(procs)
        one = statistics.median(x for c in samples for x in c)
        rnd = statistics.median(rounds)
        interval, share = cpu_share(samples, a.interval)
        print(f"| {n} | {mib:.0f} MiB | {one * 1e3:.2f} ms | {rnd * 1e3:.1f} ms | {interval:.1f} s "
              f"| {share * 100:.3f} % |")
    if a.per_mb:
        print("\n| anon memory | one sample (median) | per 100 MiB |")
        print("|---|---|---|")
        for mb in [int(x) for x in a.per_mb.split(",") if x]:
            procs = start(1, mb)
            try:
                samples, _, mib = measure(procs, a.rounds)
            finally:
                stop(procs)
            one = statistics.median(samples[0])
            print(f"| {mib:.0f} MiB | {one * 1e3:.2f} ms | {one * 1e3 / mib * 100:.2f} ms |")


if __name__ == "__main__":
    main()
