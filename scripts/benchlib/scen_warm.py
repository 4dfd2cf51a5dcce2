"""Scenario 8: warm workers — restart, reload and memory, against gunicorn --preload.

The numbers issue 17 (per-node warm templates) is judged by, for every server in
the run (best with ``--servers numaserve,numaserve-exec,gunicorn-preload,gunicorn,uvicorn``):

- *kill -9 → replacement serving*: 2 workers, idle; SIGKILL one, then ask ``GET /``
  on a new connection every 2 ms until a process that was not serving before the
  kill answers (the replacement took a connection).  Several kills per server, each
  after the previous replacement is ready.
- *reload of 2 slots under load*: the closed loop of scenario 3 (8 clients, POST
  /cpu5, new connection per request); numaserve's reload is asked in-process (the
  ops request the CLI sends, without the CLI's interpreter start) and is done when
  its operation ends; the peers get SIGHUP and are done when every old worker is
  gone and as many new ones logged their start-up.  Reported: done time, failed
  requests, and the worst 0.5 s window relative to the baseline.
- *memory and start-up with W workers* (8 and 32): all workers ready (from spawn),
  then the whole process tree's PSS and RSS (``smaps_rollup``).

The machine is shared with other work: every number is a median of the repetitions
in one run, servers interleaved.  ``BENCH_NUMASERVE_BASELINE=<checkout>`` adds a
"numaserve-base" server run from another checkout (e.g. main before a change), so
before and after are measured side by side in the same run.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import time
from typing import Any

import psutil

from benchlib import procs
from benchlib.common import Ctx, summarize
from benchlib.scen_resilience import WINDOW_S, _count, _start_load, _windows, analyse
from benchlib.servers import Server, ServerConfig, http_get

POLL_S = 0.002
POLL_OP_S = 0.05  # following a reload: as often as the peers' replacement is polled


BASE_LABEL = "numaserve-base"


def _cfg(kind: str, workers: int) -> ServerConfig:
    """A server to start; ``numaserve-base`` is numaserve from ``BENCH_NUMASERVE_BASELINE``."""
    if kind == BASE_LABEL:
        return ServerConfig("numaserve", workers=workers, label=BASE_LABEL,
                            checkout=os.environ["BENCH_NUMASERVE_BASELINE"])
    return ServerConfig(kind, workers=workers)


def _kinds(ctx: Ctx, rep: int) -> list[str]:
    kinds = ctx.order(rep)
    if os.environ.get("BENCH_NUMASERVE_BASELINE") and "numaserve" in kinds:
        kinds.append(BASE_LABEL)
        random.Random(ctx.seed * 1000 + rep).shuffle(kinds)
    return kinds


def tree_memory_mb(pid: int) -> dict[str, float]:
    """PSS and RSS of ``pid`` and every descendant, in MiB."""
    pss = rss = 0
    n = 0
    for p in [psutil.Process(pid), *procs.descendants(pid)]:
        try:
            info = p.memory_full_info()
        except psutil.Error:
            continue
        pss += getattr(info, "pss", 0)
        rss += info.rss
        n += 1
    return {"tree_pss_mb": round(pss / 1048576, 1), "tree_rss_mb": round(rss / 1048576, 1), "processes": n}


def _answering_pid(url: str) -> int | None:
    try:
        status, body = http_get(url + "/", timeout=1.0)
        return int(json.loads(body)["pid"]) if status == 200 else None
    except (OSError, ValueError, KeyError):
        return None


def kill_to_serving(srv: Server, kills: int) -> list[float | None]:
    out: list[float | None] = []
    for _ in range(kills):
        deadline = time.monotonic() + 30
        while not (srv.all_ready() and len(srv.worker_pids()) >= srv.cfg.workers):
            if time.monotonic() > deadline:
                return out + [None]
            time.sleep(0.05)
        time.sleep(0.5)
        before = set(srv.worker_pids())
        victim = sorted(before)[0]
        t0 = time.perf_counter()
        os.kill(victim, signal.SIGKILL)
        got = None
        while time.perf_counter() - t0 < 10.0:
            pid = _answering_pid(srv.url)
            if pid is not None and pid not in before:
                got = time.perf_counter() - t0
                break
            time.sleep(POLL_S)
        out.append(None if got is None else round(got, 4))
    return out


def _reload_numaserve(srv: Server, timeout: float) -> dict[str, Any]:
    """Ask for the reload, then follow its operation the way ``numaserve reload --wait`` does.

    The poll is the cheap ``operation`` request (one operation's record), not ``status``
    (every slot, template and worker: ~2 ms of the supervisor's CPU per call, which at a
    10 ms poll took ~0.06 CPU-s from the very window being measured).  The done time is
    the operation's own end (``finished``, wall clock), so the poll interval adds nothing
    to it; the peers are polled every 50 ms (``Server.wait_workers_replaced``).
    """
    t0 = time.perf_counter()
    w0 = time.time()
    r = srv.ops("reload", {}, timeout=5.0)
    op_id = (r.get("operation") or {}).get("id")
    while time.perf_counter() - t0 < timeout:
        time.sleep(POLL_OP_S)
        op = srv.ops("operation", {"id": op_id}, timeout=2.0)["operation"]
        if op["state"] != "running":
            done = (op["finished"] - w0) if op.get("finished") else time.perf_counter() - t0
            return {"ok": op["state"] == "succeeded", "done_s": round(done, 3),
                    "detail": op.get("result", "")[-200:],
                    "steps": [(s["t"], s["message"]) for s in op.get("steps", [])]}
    return {"ok": False, "done_s": None, "detail": "timeout"}


def reload_under_load(ctx: Ctx, kind: str, duration: float, baseline_s: float) -> dict[str, Any]:
    with Server(_cfg(kind, 2)).start() as srv:
        srv.wait_ready()
        bg = _start_load(srv, duration)
        time.sleep(baseline_s)
        t_reload = time.perf_counter()
        rel = _reload_numaserve(srv, duration) if srv.cfg.kind == "numaserve" else srv.reload(timeout=duration)
        t_done = time.perf_counter() if rel["ok"] else None
        run = bg.join()
    t0 = run.started
    base = [v for t, v in _windows(run) if 0.5 <= t and t + WINDOW_S <= t_reload - t0]
    baseline = statistics.median(base) if base else 0.0
    a = analyse(run, t_reload - t0, None if t_done is None else t_done - t0, run.ended - t0 - 0.5, baseline)
    a.update(done_s=rel["done_s"], ok=rel["ok"], baseline_rps=round(baseline, 1), steps=rel.get("steps"))
    # the same failures per second before the reload: admission that sheds under this load anyway
    # is not the reload's doing (the reload window is its duration + 3 s, see ``analyse``)
    b_from, b_to = 0.5, t_reload - t0
    b_failed = sum(_count(run, c, b_from, b_to) for c in ("error", "503", "504", "429", "other"))
    a["baseline_failed_per_s"] = round(b_failed / (b_to - b_from), 1) if b_to > b_from else None
    window = (rel["done_s"] or 0.0) + 3.0
    if a["baseline_failed_per_s"] is not None:
        a["failed_beyond_baseline"] = round(a["failed"] - a["baseline_failed_per_s"] * window)
    return a


def memory_and_ready(kind: str, workers: int) -> dict[str, Any]:
    with Server(_cfg(kind, workers)).start() as srv:
        ready = srv.wait_ready(timeout=300.0)
        time.sleep(1.0)
        return {"workers": workers, **ready, **tree_memory_mb(srv.master_pid)}


def run(ctx: Ctx) -> dict[str, Any]:
    kills = ctx.pick(5, 7)
    reps = ctx.pick(1, ctx.reps)
    duration = ctx.pick(7.0, 9.0)
    # BENCH_WARM_SIZES=8,32 overrides the worker counts of the memory/start-up runs
    sizes = tuple(int(x) for x in os.environ.get("BENCH_WARM_SIZES", "").split(",") if x.strip()) \
        or ctx.pick((8,), (8, 32))
    rows: list[dict[str, Any]] = []
    kill_raw: dict[str, list[float | None]] = {}
    reload_raw: dict[str, list[dict[str, Any]]] = {}
    mem_raw: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rep in range(reps):
        for kind in _kinds(ctx, rep):
            with Server(_cfg(kind, 2)).start() as srv:
                srv.wait_ready()
                ks = kill_to_serving(srv, kills)
            kill_raw.setdefault(kind, []).extend(ks)
            r = reload_under_load(ctx, kind, duration, 2.0)
            reload_raw.setdefault(kind, []).append(r)
            ctx.log(f"warm rep {rep + 1} {kind:16} kill->serving {ks} | reload done {r['done_s']} s failed "
                    f"{r['failed']} (before it: {r.get('baseline_failed_per_s')}/s) worst "
                    f"{r['worst_window_x_baseline']} steps {r.get('steps')}")
            for w in sizes:
                m = memory_and_ready(kind, w)
                mem_raw.setdefault((kind, w), []).append(m)
                ctx.log(f"warm rep {rep + 1} {kind:16} {w} workers ready {m['all_ready_s']} s, tree PSS "
                        f"{m['tree_pss_mb']} MB RSS {m['tree_rss_mb']} MB ({m['processes']} processes)")
    for kind in kill_raw:
        rel = reload_raw.get(kind, [])
        row: dict[str, Any] = {
            "server": kind,
            "kill_to_serving_s": summarize(kill_raw[kind]),
            "kill_samples": kill_raw[kind],
            "reload_done_s": summarize(r["done_s"] for r in rel),
            "reload_failed": summarize(r["failed"] for r in rel),
            "reload_worst_window": summarize(r["worst_window_x_baseline"] for r in rel),
            "reload_baseline_failed_per_s": summarize(r.get("baseline_failed_per_s") for r in rel),
            "reload_failed_beyond_baseline": summarize(r.get("failed_beyond_baseline") for r in rel),
            "reload_runs": rel,
        }
        for w in sizes:
            ms = mem_raw.get((kind, w), [])
            row[f"w{w}"] = {k: summarize(m[k] for m in ms) for k in ("all_ready_s", "tree_pss_mb", "tree_rss_mb")}
        rows.append(row)
    return {
        "title": "Warm workers: kill -9 to serving, reload of 2 slots, memory and start-up",
        "params": {"kills_per_rep": kills, "reps": reps, "reload_load": "8 clients POST /cpu5, new connection each",
                   "sizes": list(sizes), "poll_s": POLL_S, "window_s": WINDOW_S},
        "rows": rows,
    }
