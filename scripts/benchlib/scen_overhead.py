"""Scenario 5: supervisor overhead with many workers; control latency.

Every server runs W workers (32 in full mode: 16x oversubscribed on 2 CPUs,
numaserve with ``--workers-per-node 32``, whose plan shares the CPUs between
workers when there are more workers than CPUs).  Measured on the supervising
process only (numaserve's supervisor, uvicorn's and gunicorn's master): CPU
while idle and while 32 keep-alive clients hit ``/``; plus the whole tree's
idle CPU and RSS, and the start-up time of all W workers.

Control latency (numaserve only; the reply to ``ratelimit set`` now waits for
every worker's Ack of the new epoch, so its round trip is the control
latency; p99 over many pushes): formerly the time from a ``ratelimit set`` push
(the ops request the CLI sends, sent in-process to leave out the CLI's ~0.3 s
interpreter start) until ``ratelimit show`` reports every slot's
``applied_epoch`` equal to the pushed epoch.  Workers report their applied
epoch in their periodic stats (every 1 s), so this is "applied and visible to
the operator", with up to 1 s of reporting delay in it.  The peers have no
runtime channel to their workers: the only way to change a setting is a
reload (scenario 3), so they have no number here.
"""

from __future__ import annotations

import time
from typing import Any

import numaserve.tools.loadtest as lt
import psutil

from benchlib import engine, procs
from benchlib.common import Ctx, summarize
from benchlib.servers import Server, ServerConfig


#: Pause between pushes: each is 3 ops requests (show, set, show), and the supervisor
#: refuses more than 50 requests/s per client (burst 100) once pushes take ~10 ms.
PUSH_GAP_S = 0.08


def _tree_rss_mb(pid: int) -> float:
    total = 0
    for p in [psutil.Process(pid), *procs.descendants(pid)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return round(total / 1048576, 1)


def _epochs(srv: Server) -> list[tuple[Any, Any]]:
    return [(s.get("epoch"), s.get("applied_epoch")) for s in srv.ops("ratelimit_show", timeout=5.0)["slots"]]


def control_latency(srv: Server, value: int, workers: int) -> tuple[float | None, int, float | None]:
    """Seconds of one ``ratelimit set`` round trip: the reply comes once every worker acknowledged
    the new epoch (explicit per-command Ack).  Returns (seconds or None if a worker did not
    apply it, acks received, the supervisor's fan-out time: first Command sent to last Ack read,
    in seconds); ``ratelimit show`` is checked afterwards to agree."""
    before = max((e or 0) for e, _ in _epochs(srv))
    t0 = time.perf_counter()
    res = srv.ops("ratelimit_set", {"concurrency": value, "all": True}, timeout=10.0)
    dt = time.perf_counter() - t0
    acks = (res or {}).get("acks") or {}
    ok = len(acks) >= workers and all(a.get("ok") for a in acks.values())
    eps = _epochs(srv)
    ok = ok and all(e is not None and e > before and a == e for e, a in eps)
    fan = (res or {}).get("acked_in_ms")
    return (dt if ok else None), len(acks), (fan / 1000.0 if ok and isinstance(fan, (int, float)) else None)


def one(ctx: Ctx, kind: str, workers: int) -> dict[str, Any]:
    idle_s = ctx.pick(1.0, 5.0)
    windows = ctx.pick(1, 3)
    load_s = ctx.pick(1.0, 8.0)
    with Server(ServerConfig(kind, workers=workers)).start() as srv:
        ready = srv.wait_ready(timeout=300.0)
        time.sleep(ctx.pick(0.5, 2.0))
        idle = [procs.cpu_over(srv.master_pid, idle_s, include_children=False)["cpu_s"] / idle_s
                for _ in range(windows)]
        tree = procs.cpu_over(srv.master_pid, idle_s)["cpu_s"] / idle_s
        rss = _tree_rss_mb(srv.master_pid)
        meter = procs.TreeCpu(srv.master_pid, include_children=False).start()
        r = engine.run(lt.LoadConfig(srv.url + "/", concurrency=32, duration=load_s, timeout=10.0))
        loaded = meter.sample() / r.result.duration_s if r.result.duration_s else None
        ctl: list[float | None] = []
        acks: list[int] = []
        fanout: list[float | None] = []
        if kind == "numaserve":
            for i in range(ctx.pick(10, 50)):
                dt, n, fan = control_latency(srv, 8 + i % 8, workers)
                ctl.append(dt)
                fanout.append(fan)
                acks.append(n)
                time.sleep(PUSH_GAP_S)
            srv.ops("ratelimit_auto", {}, timeout=10.0)
        return {
            "workers": workers,
            "first_answer_s": ready["first_answer_s"],
            "all_ready_s": ready["all_ready_s"],
            "supervisor_idle_cpu_pct": [round(100 * x, 2) for x in idle],
            "tree_idle_cpu_pct": round(100 * tree, 2),
            "tree_rss_mb": rss,
            "supervisor_load_cpu_pct": None if loaded is None else round(100 * loaded, 2),
            "load_rps": round(r.ok / r.result.duration_s, 1) if r.result.duration_s else 0.0,
            "load_failed": r.failed,
            "control_latency_s": [None if x is None else round(x, 4) for x in ctl],
            "control_acks": acks,
            "control_fanout_s": [None if x is None else round(x, 4) for x in fanout],
            "control_fanout_p99_ms": _p99_ms(fanout) if fanout else None,
            "control_p99_ms": _p99_ms(ctl),
        }


def _p99_ms(xs: list[float | None]) -> float | None:
    """p99 of the round trips (a push some worker did not apply counts as infinitely slow)."""
    if not xs:
        return None
    vals = sorted(float("inf") if x is None else x for x in xs)
    v = vals[min(len(vals) - 1, int(0.99 * len(vals)))]
    return None if v == float("inf") else round(v * 1000.0, 2)


def run(ctx: Ctx) -> dict[str, Any]:
    workers = ctx.pick(8, 32)
    rows = []
    for kind in ctx.order(0):
        res = one(ctx, kind, workers)
        ctx.log(f"overhead {kind:9} {workers} workers ready {res['all_ready_s']} s, supervisor idle "
                f"{res['supervisor_idle_cpu_pct']} % load {res['supervisor_load_cpu_pct']} %, "
                f"control p99 {res['control_p99_ms']} ms over {len(res['control_latency_s'])} pushes")
        rows.append({"server": kind, **res,
                     "supervisor_idle_cpu_pct_summary": summarize(res["supervisor_idle_cpu_pct"]),
                     "control_latency_summary": summarize(res["control_latency_s"])})
    return {
        "title": f"Supervisor overhead with {workers} workers",
        "params": {"workers": workers, "idle_window_s": ctx.pick(1.0, 5.0), "load": "32 keep-alive clients on /",
                   "reps": 1, "note": "one start per server (32-worker start-ups are the expensive part); "
                                      "idle CPU over several windows"},
        "rows": rows,
    }
