"""Scenario "hotpath": per-request and per-chunk cost with every default on, against every peer.

Load from ``wrk`` when it is installed (a C load generator: the client costs
the shared CPUs far less than the Python one, so more of the machine is left
to the servers), else from ``numaserve.loadtest``.  Measured per server:

- *tiny, shared*: 2 workers, ``wrk -t2 -c64`` on ``/``, everything on both CPUs;
- *tiny, new connection each*: the same with ``Connection: close`` on every request (a TCP
  handshake, an accept and a close per request: what the admission sentinel's wake-ups cost);
- *tiny, pinned*: 1 worker, the server tree on CPU 1 and the generator on CPU 0;
- *sse, pinned*: ``/sse100`` (100 events per response, chunked), CPU per chunk;
- *32 workers*: numaserve ``--workers-per-node 32`` and ``gunicorn -w 32`` on the
  2 CPUs, tiny requests, shared;
- *supervisor idle*: numaserve's supervisor CPU with 32 idle workers
  (``psutil`` cpu_times delta of the supervising process over the window).

Server CPU is the whole server tree's user+system time (workers, master,
helpers) divided by the requests (chunks) answered in the window.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from typing import Any

import psutil

import numaserve.tools.loadtest as lt
from benchlib import engine, procs
from benchlib.common import Ctx, summarize_rows
from benchlib.servers import Server, ServerConfig

PEERS = ("numaserve", "uvicorn", "gunicorn", "granian")
KEYS = ("rps", "server_cpu_us_per_req", "server_cpu_us_per_chunk", "failed", "busy_workers", "cs_per_req")
SSE_CHUNKS = 100


def _wrk(url: str, threads: int, conns: int, seconds: float, cpus: set[int] | None,
         close: bool = False) -> tuple[int, float, int]:
    """(requests answered, duration s, non-2xx + socket errors) from one wrk run (``close``: a new
    connection per request)."""
    argv = ["wrk", f"-t{threads}", f"-c{conns}", f"-d{max(1, round(seconds))}s",
            *(["-H", "Connection: close"] if close else []), url]
    if cpus:
        argv = ["taskset", "-c", ",".join(map(str, sorted(cpus))), *argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 30).stdout
    m = re.search(r"(\d+) requests in ([\d.]+)(m?s)", out)
    if not m:
        raise RuntimeError(f"wrk output not understood: {out[-300:]}")
    n, dur = int(m.group(1)), float(m.group(2)) / (1000.0 if m.group(3) == "ms" else 1.0)
    bad = 0
    for pat in (r"Non-2xx or 3xx responses: (\d+)", r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)"):
        e = re.search(pat, out)
        if e:
            bad += sum(int(x) for x in e.groups())
    return n, dur, bad


def _load(srv: Server, path: str, seconds: float, cpus: set[int] | None, conns: int,
          close: bool = False) -> tuple[int, float, int]:
    if shutil.which("wrk"):
        return _wrk(srv.url + path, 1 if cpus else 2, conns, seconds, cpus, close)
    r = engine.run(lt.LoadConfig(srv.url + path, concurrency=conns, duration=seconds, timeout=10.0,
                                 keepalive=not close), cpus=cpus)
    return r.ok, r.result.duration_s, r.failed


def _measure(srv: Server, path: str, seconds: float, cpus: set[int] | None, conns: int,
             chunks: int = 0, close: bool = False) -> dict[str, Any]:
    meter = procs.TreeCpu(srv.master_pid).start()
    n, dur, bad = _load(srv, path, seconds, cpus, conns, close)
    cpu = meter.sample()
    row: dict[str, Any] = {"rps": round(n / dur, 1) if dur else 0.0, "failed": bad,
                           "server_cpu_us_per_req": round(cpu / n * 1e6, 1) if n else None,
                           "server_cpu_us_per_chunk": None}
    if chunks and n:
        row["server_cpu_us_per_chunk"] = round(cpu / (n * chunks) * 1e6, 2)
    return row


def supervisor_idle(ctx: Ctx, workers: int, window: float) -> dict[str, Any]:
    """numaserve's supervisor CPU with ``workers`` idle workers (cpu_times delta)."""
    with Server(ServerConfig("numaserve", workers=workers)).start() as srv:
        srv.wait_ready(timeout=300.0)
        time.sleep(ctx.pick(2.0, 5.0))   # start-up spikes (spawns, first stats) out of the window
        p = psutil.Process(srv.master_pid)
        a = p.cpu_times()
        time.sleep(window)
        b = p.cpu_times()
        used = (b.user - a.user) + (b.system - a.system)
        return {"workers": workers, "window_s": window, "supervisor_cpu_s": round(used, 3),
                "supervisor_idle_cpu_pct": round(100.0 * used / window, 2)}


def many_workers(ctx: Ctx, many: int, seconds: float,
                 kinds: tuple[str, ...] = ("numaserve", "gunicorn")) -> list[tuple[str, dict[str, Any]]]:
    """The *32 workers* part: each server with ``many`` workers on the shared CPUs, tiny
    requests, ``wrk -t2 -c64``; besides throughput and CPU, how many workers did the work
    (busy: more than a quarter of the busiest one's CPU) and context switches per request
    (a worker that reads several requests per wake-up switches less)."""
    out = []
    for kind in kinds:
        with Server(ServerConfig(kind, workers=many)).start() as srv:
            srv.wait_ready(timeout=300.0)
            _load(srv, "/", 1.0, None, 16)
            workers = srv.worker_pids()
            before = _per_process(workers + [srv.master_pid])
            row = _measure(srv, "/", seconds, None, 64)
            after = _per_process(workers + [srv.master_pid])
            cpu = [after[p][0] - before[p][0] for p in workers if p in before and p in after]
            top = max(cpu, default=0.0)
            row["busy_workers"] = sum(1 for c in cpu if top and c > top / 4.0)
            row["workers"] = len(workers)
            done = row["rps"] * seconds
            cs = sum(after[p][1] - before[p][1] for p in after if p in before)
            row["cs_per_req"] = round(cs / done, 3) if done else None
            out.append((kind, row))
            ctx.log(f"hotpath {many} workers {kind:9} {row['rps']:8.0f} req/s {row['server_cpu_us_per_req']} µs/req "
                    f"busy {row['busy_workers']}/{len(workers)} cs/req {row['cs_per_req']}")
    return out


def _per_process(pids: list[int]) -> dict[int, tuple[float, int]]:
    """pid -> (CPU seconds, context switches) of each live process of ``pids``."""
    out = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                t, c = p.cpu_times(), p.num_ctx_switches()
        except psutil.Error:
            continue
        out[pid] = (t.user + t.system, c.voluntary + c.involuntary)
    return out


def run(ctx: Ctx) -> dict[str, Any]:
    seconds = ctx.pick(2.0, 5.0)
    pinned_ok = {0, 1} <= set(os.sched_getaffinity(0))
    peers = [k for k in PEERS if k in ctx.servers or k == "granian"]
    if shutil.which("granian") is None:
        try:
            import granian  # noqa: F401
        except ImportError:
            peers.remove("granian")
    raw: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for rep in range(ctx.reps):
        order = ctx.order(rep) + [k for k in peers if k not in ctx.order(rep)]
        for placement in ("shared", "pinned"):
            if placement == "pinned" and not pinned_ok:
                continue
            for kind in order:
                if kind not in peers:
                    continue
                cfg = ServerConfig(kind, workers=2 if placement == "shared" else 1,
                                   cpus=(1,) if placement == "pinned" else None)
                gen = {0} if placement == "pinned" else None
                with Server(cfg).start() as srv:
                    srv.wait_ready()
                    _load(srv, "/", 1.0, gen, 16)   # warm-up
                    row = _measure(srv, "/", seconds, gen, 64)
                    raw.setdefault(("tiny", placement, kind), []).append(row)
                    ctx.log(f"hotpath rep {rep + 1} {placement:6} tiny {kind:9} {row['rps']:8.0f} req/s "
                            f"{row['server_cpu_us_per_req']} µs CPU/req")
                    if placement == "shared":
                        row = _measure(srv, "/", seconds, gen, 16, close=True)
                        raw.setdefault(("tiny, new connection each", placement, kind), []).append(row)
                        ctx.log(f"hotpath rep {rep + 1} {placement:6} new-conn {kind:9} {row['rps']:8.0f} req/s "
                                f"{row['server_cpu_us_per_req']} µs CPU/req")
                    if placement == "pinned":
                        row = _measure(srv, "/sse100", seconds, gen, 16, chunks=SSE_CHUNKS)
                        raw.setdefault(("sse", placement, kind), []).append(row)
                        ctx.log(f"hotpath rep {rep + 1} {placement:6} sse  {kind:9} "
                                f"{row['server_cpu_us_per_chunk']} µs CPU/chunk")
    many = ctx.pick(8, 32)
    for kind, row in many_workers(ctx, many, seconds):
        raw.setdefault((f"tiny, {many} workers", "shared", kind), []).append(row)
    idle = supervisor_idle(ctx, many, ctx.pick(10.0, 30.0))
    ctx.log(f"hotpath supervisor idle with {many} workers: {idle['supervisor_idle_cpu_pct']} %")
    rows = [{"variant": name, "placement": pl, "server": kind, "reps": reps, **summarize_rows(reps, KEYS)}
            for (name, pl, kind), reps in raw.items()]
    return {
        "title": "Hot path: per-request and per-chunk cost, every default on",
        "params": {"duration_s": seconds, "reps": ctx.reps, "load": "wrk" if shutil.which("wrk") else "loadtest",
                   "shared": "2 workers, wrk -t2 -c64, all on both CPUs",
                   "new_connection_each": "shared, wrk -t2 -c16 -H 'Connection: close'",
                   "pinned": "1 worker, server tree on CPU 1, wrk -t1 on CPU 0 (-c64 tiny, -c16 sse)",
                   "sse": f"/sse100: {SSE_CHUNKS} events per response, chunked",
                   "many_workers": many},
        "rows": rows,
        "supervisor_idle": idle,
    }
