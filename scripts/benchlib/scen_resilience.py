"""Scenario 3: reload under load, and ``kill -9`` of a worker under load.

One closed-loop run per server and repetition (8 clients sending ``POST
/cpu5`` on a new connection each, 2 workers; POST so that a request lost
with its connection counts as failed instead of being resent by the client): a quiet baseline, then a rolling reload the server's own
way (numaserve ``reload --wait``; uvicorn and gunicorn: SIGHUP to the master),
then SIGKILL of the busiest worker (most CPU in the last second, so the kill
always hits traffic).

Per event: failed requests (non-2xx answers plus connection errors) from the
event until 3 s after it finished, the worst 0.5 s throughput relative to the
baseline, and *time to full capacity*: from the event until the last 0.5 s
window below 80 % of the baseline (0 when it never dips; missing when the
run ends still below).  Also the server's
own "done" signal: the reload command returning (numaserve) or every old
worker gone and as many new ones started (peers); after a kill, the
replacement ready.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from typing import Any

import numaserve.loadtest as lt
import psutil

from benchlib import engine
from benchlib.common import Ctx, summarize_rows
from benchlib.servers import Server, ServerConfig

KEYS = ("baseline_rps", "failed", "connection_errors", "error_responses", "worst_window_x_baseline",
        "time_to_full_capacity_s", "done_s")
WINDOW_S = 0.5


def busiest(pids: list[int], sample_s: float = 1.0) -> int:
    """The worker that used the most CPU over ``sample_s``."""
    def cpu(pid: int) -> float:
        try:
            t = psutil.Process(pid).cpu_times()
            return float(t.user + t.system)
        except psutil.Error:
            return 0.0

    before = {p: cpu(p) for p in pids}
    time.sleep(sample_s)
    return max(pids, key=lambda p: cpu(p) - before[p])


def _windows(run: engine.Run) -> list[tuple[float, float]]:
    """(window start s, 2xx per second) over consecutive WINDOW_S windows."""
    per = int(round(WINDOW_S / engine.BIN_S))
    series = run.series("2xx")
    out = []
    for i in range(0, len(series) - per + 1, per):
        out.append((series[i][0], sum(c for _, c in series[i:i + per]) / WINDOW_S))
    return out


def _count(run: engine.Run, what: str, t_from: float, t_to: float) -> int:
    """Events in the time-line buckets that overlap [t_from, t_to)."""
    return sum(c for t, c in run.series(what) if t + engine.BIN_S > t_from and t < t_to)


def analyse(run: engine.Run, t_event: float, t_done: float | None, t_limit: float,
            baseline: float) -> dict[str, Any]:
    """Failures and capacity around one event (times in seconds since the run started)."""
    end = (t_done if t_done is not None else t_limit - 3.0) + 3.0
    end = min(end, t_limit)
    wins = [(t, v) for t, v in _windows(run) if t + WINDOW_S > t_event and t + WINDOW_S <= end]
    low = [t + WINDOW_S for t, v in wins if v < 0.8 * baseline]
    recovered = not wins or wins[-1][1] >= 0.8 * baseline
    errs = _count(run, "error", t_event, end)
    bad = sum(_count(run, c, t_event, end) for c in ("503", "504", "429", "other"))
    return {
        "failed": errs + bad,
        "connection_errors": errs,
        "error_responses": bad,
        "worst_window_x_baseline": round(min(v for _, v in wins) / baseline, 2) if wins and baseline else None,
        # None: still under 80 % at the end of the observed window
        "time_to_full_capacity_s": (round(max(low) - t_event, 2) if low else 0.0) if recovered else None,
        "recovered": recovered,
    }


def one(ctx: Ctx, kind: str, duration: float, baseline_s: float = 3.0) -> dict[str, Any]:
    """Reload then kill under one load run; returns per-event analyses."""
    with Server(ServerConfig(kind, workers=2)).start() as srv:
        srv.wait_ready()
        engine.run(lt.LoadConfig(srv.url + "/cpu5", concurrency=4, duration=0.5))
        # POST: not idempotent, so the load generator never silently resends a
        # request that died with its connection (it would for a GET).  A new
        # connection per request: kept-alive connections stay where they were
        # accepted, so a replacement worker would get no traffic until clients
        # reconnect, and "capacity" would measure the clients, not the server.
        bg = engine.Background(lt.LoadConfig(srv.url + "/cpu5", concurrency=8, duration=duration, timeout=5.0,
                                             method="POST", body=b"{}", keepalive=False)).start()
        time.sleep(baseline_s)
        t_reload = time.perf_counter()
        rel = srv.reload(timeout=duration)
        t_reload_done = time.perf_counter() if rel["ok"] else None
        wait_until = max(time.perf_counter() + 2.0, bg.started + duration * 0.55)
        time.sleep(max(0.0, wait_until - time.perf_counter()))
        pids = srv.worker_pids()
        victim = busiest(pids, 0.5) if pids else None
        lines = srv.startup_lines()
        t_kill = time.perf_counter()
        replaced = None
        if victim is not None:
            os.kill(victim, signal.SIGKILL)
            replaced = srv.wait_workers_replaced({victim}, max(1.0, bg.started + duration - time.perf_counter()),
                                                 lines)
        run = bg.join()
    t0 = run.started
    base_wins = [v for t, v in _windows(run) if 0.5 <= t and t + WINDOW_S <= t_reload - t0]
    baseline = statistics.median(base_wins) if base_wins else 0.0
    limit = run.ended - t0 - 0.5
    reload_a = analyse(run, t_reload - t0, None if t_reload_done is None else t_reload_done - t0,
                       t_kill - t0 - 1.5 * engine.BIN_S, baseline)   # stop short of the kill's buckets
    reload_a.update(done_s=rel["done_s"], ok=rel["ok"], baseline_rps=round(baseline, 1))
    kill_a = analyse(run, t_kill - t0, None if replaced is None else t_kill - t0 + replaced, limit, baseline)
    kill_a.update(done_s=None if replaced is None else round(replaced, 3), ok=replaced is not None,
                  baseline_rps=round(baseline, 1))
    return {
        "reload": reload_a,
        "kill": kill_a,
        "timeline": {"t_reload": round(t_reload - t0, 2),
                     "t_reload_done": None if t_reload_done is None else round(t_reload_done - t0, 2),
                     "t_kill": round(t_kill - t0, 2),
                     "t_replaced": None if replaced is None else round(t_kill - t0 + replaced, 2),
                     "rps": [(t, round(v, 1)) for t, v in _windows(run)],
                     "errors": [(t, c) for t, c in run.series("error") if c]},
        "total_failed": run.failed,
    }


def run(ctx: Ctx) -> dict[str, Any]:
    duration = ctx.pick(9.0, 17.0)
    baseline_s = ctx.pick(2.0, 3.0)
    raw: dict[tuple[str, str], list[dict[str, Any]]] = {}
    timelines: dict[str, Any] = {}
    for rep in range(ctx.reps):
        for kind in ctx.order(rep):
            res = one(ctx, kind, duration, baseline_s)
            for ev in ("reload", "kill"):
                raw.setdefault((ev, kind), []).append(res[ev])
            timelines.setdefault(kind, res["timeline"])
            ctx.log(f"resilience rep {rep + 1} {kind:9} reload failed {res['reload']['failed']} "
                    f"full-cap {res['reload']['time_to_full_capacity_s']} s | kill failed {res['kill']['failed']} "
                    f"full-cap {res['kill']['time_to_full_capacity_s']} s")
    rows = [{"event": ev, "server": kind, "reps": reps, **summarize_rows(reps, KEYS)}
            for (ev, kind), reps in sorted(raw.items())]
    return {
        "title": "Reload and kill -9 under load",
        "params": {"duration_s": duration, "load": "closed loop, 8 clients, POST /cpu5, new connection per request (no client retry)", "workers": 2,
                   "reps": ctx.reps, "window_s": WINDOW_S, "full_capacity": ">= 80 % of the baseline"},
        "rows": rows,
        "timelines": timelines,
    }
