#!/usr/bin/env python3
"""The supervisor with many idle workers: its CPU, and the ``ratelimit set`` round trip.

    flock /tmp/numaserve-heavy.lock scripts/bench_idle.py                 # 32 workers, 30 s idle, 100 pushes
    flock /tmp/numaserve-heavy.lock scripts/bench_idle.py --profile p.txt # + a py-spy profile of the idle supervisor
    flock /tmp/numaserve-heavy.lock scripts/bench_idle.py --baseline ../base --rounds 2   # before/after, alternating

One numaserve start with ``--workers-per-node W`` (the 32-worker rows of
docs/benchmarks.md § 1b / § 5), every default on.  Measured on the
supervising process only:

- idle CPU: ``psutil`` user+system delta over the window, after a settling
  pause (spawns and first checks out of it), as a % of one CPU;
- the same CPU split by thread: the Python (asyncio) thread and the rest
  (libzmq's I/O thread, the admin server's), which a py-spy profile of
  Python frames does not see;
- optionally a ``py-spy record`` of the idle supervisor (raw folded stacks)
  over a second window, so the profile does not disturb the number;
- ``ping`` round trip (the ops client's floor: connect, request, reply);
- ``ratelimit set`` round trips: the reply comes once every worker acknowledged
  the new epoch (``benchlib.scen_overhead.control_latency``, which also checks
  that ``ratelimit show`` agrees), paced to stay under the ops rate limit, and
  the supervisor's CPU per push; beside it the fan-out the supervisor reports
  (``acked_in_ms``: first Command sent to last Ack read).

``--baseline DIR`` runs a second source tree (e.g. ``git worktree add ../base
main``) the same way, alternating with this one ``--rounds`` times, so the
before/after pair shares the machine's load.
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


def _threads(p: psutil.Process) -> dict[int, float]:
    return {t.id: t.user_time + t.system_time for t in p.threads()}


def _syscalls(pid: int, window: float) -> dict[str, Any]:
    """``strace -c`` of the supervisor's main (asyncio) thread over a second window: its wake-ups
    (``epoll_wait`` calls: one per pass of the event loop) and reads of /proc, per second.

    A second window, like the profile's: ptrace slows every syscall, so the CPU figure is never
    taken while it runs.
    """
    if shutil.which("strace") is None:
        return {"wakeups": "strace not installed"}
    res = subprocess.run(["timeout", "-s", "INT", str(window), "strace", "-c", "-p", str(pid)],
                         capture_output=True, text=True, check=False)
    calls: dict[str, int] = {}
    for line in res.stderr.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1].isidentifier() and parts[-1] != "total":
            try:
                calls[parts[-1]] = int(parts[3])
            except ValueError:
                continue
    per_s = {k: round(v / window, 1) for k, v in sorted(calls.items(), key=lambda kv: -kv[1])}
    return {"main_thread_epoll_wait_per_s": per_s.get("epoll_wait", 0.0),
            "main_thread_syscalls_per_s": dict(list(per_s.items())[:12])}


def run(workers: int, window: float, pushes: int, profile: str | None, checkout: str = "",
        wakeups: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"checkout": checkout or "this", "workers": workers, "window_s": window, "pushes": pushes}
    with Server(ServerConfig("numaserve", workers=workers, checkout=checkout)).start() as srv:
        srv.wait_ready(timeout=300.0)
        time.sleep(5.0)
        p = psutil.Process(srv.master_pid)
        a, ta, t0 = _cpu(p), _threads(p), time.monotonic()
        time.sleep(window)
        used, tb, dt = _cpu(p) - a, _threads(p), time.monotonic() - t0
        out["supervisor_idle_cpu_pct"] = round(100.0 * used / dt, 3)
        main = tb.get(p.pid, 0.0) - ta.get(p.pid, 0.0)   # the main thread's id is the pid
        out["supervisor_idle_cpu_pct_python_thread"] = round(100.0 * main / dt, 3)
        out["supervisor_idle_cpu_pct_other_threads"] = round(
            100.0 * (sum(tb.values()) - sum(ta.get(t, 0.0) for t in tb) - main) / dt, 3)
        if wakeups:
            out.update(_syscalls(srv.master_pid, window))
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
        fan: list[float] = []
        failed = 0
        a = _cpu(p)
        for i in range(pushes):
            d, _, f = control_latency(srv, 8 + i % 8, workers)
            if d is None:
                failed += 1
            else:
                lat.append(d)
            if f is not None:
                fan.append(f)
            time.sleep(0.08)   # 3 ops requests per push: stay under the per-client ops rate limit
        out["supervisor_cpu_ms_per_push"] = round((_cpu(p) - a) / pushes * 1000.0, 2)  # incl. 2 ratelimit show
        srv.ops("ratelimit_auto", {}, timeout=10.0)
        out["ratelimit_set_failed"] = failed
        if lat:
            out.update(ratelimit_set_p50_ms=_pct(lat, 0.5), ratelimit_set_p99_ms=_pct(lat, 0.99),
                       ratelimit_set_min_ms=round(min(lat) * 1000.0, 2))
        if fan:
            out.update(fanout_p50_ms=_pct(fan, 0.5), fanout_p99_ms=_pct(fan, 0.99))
    out["loadavg"] = [round(x, 2) for x in psutil.getloadavg()]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=32)
    ap.add_argument("--window", type=float, default=30.0, help="idle window, seconds")
    ap.add_argument("--pushes", type=int, default=100, help="ratelimit set round trips (and pings)")
    ap.add_argument("--profile", help="write a py-spy raw profile of the idle supervisor here")
    ap.add_argument("--wakeups", action="store_true",
                    help="also count the idle supervisor's main-thread syscalls (strace -c) over a second window")
    ap.add_argument("--baseline", default="", help="another numaserve source tree, run alternately with this one")
    ap.add_argument("--rounds", type=int, default=1, help="with --baseline: how many before/after pairs")
    args = ap.parse_args()
    trees = [""] + ([str(Path(args.baseline).resolve())] if args.baseline else [])
    for r in range(args.rounds if args.baseline else 1):
        for tree in (trees if r % 2 == 0 else trees[::-1]):
            prof = f"{args.profile}.{'base' if tree else 'this'}.{r}" if args.profile and args.baseline else args.profile
            print(json.dumps(run(args.workers, args.window, args.pushes, prof, tree, args.wakeups)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
