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

Two more runs per server (full mode), each on a fresh server: a *kill storm* (10 SIGKILLs of ready workers within 5 s, as the OOM
killer or an operator would) and a *frozen worker* (SIGSTOP of the busiest
worker, watched for 16 s: longer than numaserve's default hang timeout and
abort grace, 13 s).
Per event: failed requests, requests delayed (answered after more than
1 s), whether the service is still up with every worker serving again, and
when the frozen worker was replaced.  ``BENCH_NUMASERVE_BASELINE=<checkout>``
adds a "numaserve-base" server run from another checkout (e.g. the main
branch before a change), to put before and after side by side.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from typing import Any

import numaserve.tools.loadtest as lt
import psutil

from benchlib import engine
from benchlib.common import Ctx, summarize_rows
from benchlib.servers import Server, ServerConfig

KEYS = ("baseline_rps", "failed", "connection_errors", "error_responses", "worst_window_x_baseline",
        "time_to_full_capacity_s", "done_s")
STORM_KEYS = ("baseline_rps", "kills", "storm_s", "failed", "delayed", "requests", "alive", "all_serving",
              "recovered_s", "replaced_s")
STORM_KILLS = 10
STORM_S = 5.0
FREEZE_WATCH_S = 16.0
RECOVER_LIMIT_S = 15.0
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


def _start_load(srv: Server, duration: float) -> engine.Background:
    """Warm up, then start the closed loop every event runs under.

    POST: not idempotent, so the load generator never silently resends a
    request that died with its connection (it would for a GET).  A new
    connection per request: kept-alive connections stay where they were
    accepted, so a replacement worker would get no traffic until clients
    reconnect, and "capacity" would measure the clients, not the server.
    """
    engine.run(lt.LoadConfig(srv.url + "/cpu5", concurrency=4, duration=0.5))
    return engine.Background(lt.LoadConfig(srv.url + "/cpu5", concurrency=8, duration=duration, timeout=5.0,
                                           method="POST", body=b"{}", keepalive=False)).start()


def one(ctx: Ctx, kind: str, duration: float, baseline_s: float = 3.0) -> dict[str, Any]:
    """Reload then kill under one load run; returns per-event analyses."""
    with Server(ServerConfig(kind, workers=2)).start() as srv:
        srv.wait_ready()
        bg = _start_load(srv, duration)
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


def _ready_victims(srv: Server) -> list[int]:
    """Workers that are serving: numaserve says so; peers' workers up for 1 s (they say nothing)."""
    if srv.cfg.kind == "numaserve":
        try:
            st = srv.ops("status", timeout=2.0)
        except Exception:
            return []
        return [int(s["pid"]) for s in st.get("slots", []) if s.get("pid") and s.get("state") == "ready"]
    out = []
    for pid in srv.worker_pids():
        try:
            if time.time() - psutil.Process(pid).create_time() >= 1.0:
                out.append(pid)
        except psutil.Error:
            continue
    return out


def _all_serving(srv: Server) -> bool:
    if srv.proc is None or srv.proc.poll() is not None:
        return False
    return srv.all_ready() if srv.cfg.kind == "numaserve" else len(_ready_victims(srv)) >= srv.cfg.workers


def storm_or_freeze(ctx: Ctx, cfg: ServerConfig, event: str, baseline_s: float) -> dict[str, Any]:
    """One load run with one event: ``"storm"`` (kill storm) or ``"freeze"`` (SIGSTOP)."""
    duration = baseline_s + (STORM_S + RECOVER_LIMIT_S if event == "storm" else FREEZE_WATCH_S) + 1.0
    victim = None
    kills = 0
    recovered = replaced = None
    with Server(cfg).start() as srv:
        srv.wait_ready()
        bg = _start_load(srv, duration)
        time.sleep(baseline_s)
        t_event = time.perf_counter()
        if event == "storm":
            turn = 0
            killed: set[int] = set()
            while kills < STORM_KILLS and time.perf_counter() - t_event < 2 * STORM_S:
                time.sleep(max(0.0, t_event + kills * STORM_S / STORM_KILLS - time.perf_counter()))
                pids = _ready_victims(srv)
                if not pids:
                    time.sleep(0.05)
                    continue
                try:
                    os.kill(pids[turn % len(pids)], signal.SIGKILL)
                    killed.add(pids[turn % len(pids)])
                    kills += 1
                    turn += 1
                except ProcessLookupError:
                    pass
            t_end = time.perf_counter()
            while time.perf_counter() - t_end < RECOVER_LIMIT_S:
                if not killed & set(srv.worker_pids()) and _all_serving(srv):
                    recovered = time.perf_counter() - t_end
                    break
                if srv.proc is not None and srv.proc.poll() is not None:
                    break
                time.sleep(0.05)
        else:
            pids = srv.worker_pids()
            victim = busiest(pids, 0.5)
            t_event = time.perf_counter()
            os.kill(victim, signal.SIGSTOP)
            while time.perf_counter() - t_event < FREEZE_WATCH_S:
                if replaced is None and victim not in srv.worker_pids() and _all_serving(srv):
                    replaced = time.perf_counter() - t_event
                time.sleep(0.1)
            t_end = time.perf_counter()
        alive = srv.proc is not None and srv.proc.poll() is None
        run = bg.join()
        if victim is not None:
            try:
                os.kill(victim, signal.SIGKILL)   # never leave a frozen process behind
            except ProcessLookupError:
                pass
    t0 = run.started
    base_wins = [v for t, v in _windows(run) if 0.5 <= t and t + WINDOW_S <= t_event - t0]
    baseline = statistics.median(base_wins) if base_wins else 0.0
    a = t_event - t0
    if event == "storm":
        b = (t_end - t0) + (recovered if recovered is not None else RECOVER_LIMIT_S) + 1.0
    else:
        b = t_end - t0
    failed = sum(_count(run, c, a, b) for c in ("error", "503", "504", "429", "other"))
    return {
        "row": {"baseline_rps": round(baseline, 1), "kills": kills if event == "storm" else None,
                "storm_s": round(t_end - t_event, 2) if event == "storm" else None,
                "failed": failed, "delayed": _count(run, "slow", a, b), "requests": failed + _count(run, "2xx", a, b),
                "alive": alive, "all_serving": (recovered is not None) if event == "storm" else None,
                "recovered_s": None if recovered is None else round(recovered, 2),
                "replaced_s": None if replaced is None else round(replaced, 2)},
        "timeline": {"t_event": round(a, 2), "t_event_end": round(t_end - t0, 2),
                     "rps": [(t, round(v, 1)) for t, v in _windows(run)],
                     "errors": [(t, c) for t, c in run.series("error") if c],
                     "slow": [(t, c) for t, c in run.series("slow") if c]},
    }


def _storm_configs(ctx: Ctx, rep: int) -> list[ServerConfig]:
    cfgs = [ServerConfig(kind, workers=2) for kind in ctx.order(rep)]
    base = os.environ.get("BENCH_NUMASERVE_BASELINE")
    if base and "numaserve" in ctx.servers:
        cfgs.append(ServerConfig("numaserve", workers=2, label="numaserve-base", checkout=base))
    return cfgs


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
    storm_raw: dict[tuple[str, str], list[dict[str, Any]]] = {}
    storm_timelines: dict[str, Any] = {}
    if not ctx.quick:   # ~40 s per server and repetition: full mode only (quick stays in its budget)
        for rep in range(ctx.reps):
            for cfg in _storm_configs(ctx, rep):
                for ev in ("storm", "freeze"):
                    res = storm_or_freeze(ctx, cfg, ev, baseline_s)
                    storm_raw.setdefault((ev, cfg.name), []).append(res["row"])
                    storm_timelines.setdefault(f"{ev} {cfg.name}", res["timeline"])
                    r = res["row"]
                    ctx.log(f"resilience rep {rep + 1} {cfg.name:14} {ev:6} kills {r['kills']} failed {r['failed']} "
                            f"delayed {r['delayed']} of {r['requests']}, up {r['alive']}, all serving "
                            f"{r['all_serving']}, replaced {r['replaced_s']} s")
    storm_rows = [{"event": ev, "server": name, "reps": reps, **summarize_rows(reps, STORM_KEYS)}
                  for (ev, name), reps in sorted(storm_raw.items())]
    return {
        "title": "Reload and kill -9 under load",
        "params": {"duration_s": duration, "load": "closed loop, 8 clients, POST /cpu5, new connection per request (no client retry)", "workers": 2,
                   "reps": ctx.reps, "window_s": WINDOW_S, "full_capacity": ">= 80 % of the baseline",
                   "storm": f"{STORM_KILLS} SIGKILLs of ready workers within {STORM_S:g} s; failed/delayed from the "
                            f"first kill to 1 s after every worker serves again (or {RECOVER_LIMIT_S:g} s)",
                   "freeze": f"SIGSTOP of the busiest worker; failed/delayed over the next {FREEZE_WATCH_S:g} s",
                   "delayed": f"answered after more than {engine.SLOW_S:g} s (client timeout 5 s: later = failed)",
                   "storm_runs": "full mode only"},
        "rows": rows,
        "timelines": timelines,
        "storm_rows": storm_rows,
        "storm_timelines": storm_timelines,
    }
