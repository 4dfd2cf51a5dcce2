"""``scripts/bench --scenarios overload-sweep``: issue 32's sweep from 0.5× to 3× of capacity.

A FastAPI app (``bench_apps/fastapp.py``) with 2 workers on every server;
``/cpu20`` (20 ms that block the loop) and ``/cpu20y`` (20 ms yielding every
5 ms); open-loop Poisson arrivals, 2 s client timeout.  Every server is
started once and they stay up side by side, so each (shape, level) runs on
every server back to back (interleaved, order shuffled per repetition): a
slow spell of the shared machine hits all of them alike.

Each run starts only once *every* server's process tree is idle again: the
peers keep burning CPU for seconds on requests whose clients timed out, and a
sweep that does not wait charges that to whoever runs next.  A server still
busy after ``idle_timeout_s`` is restarted (logged, counted in the result).

Capacity C is measured first, in the same run: each server's closed-loop rate
on ``/cpu20y`` (a new connection per request, see ``scen_overload._capacity``),
C = their median.  Per (server, shape, level): ok/s, 2xx within 500 ms per s,
admitted p99, the p99 of 503s answered on a new connection, % shed, client
timeouts; then one verdict line per done-when criterion of issue 32
(``verdicts``).  ``--base DIR`` adds ``numaserve-base``: numaserve run from
another source tree (before/after in one run); ``NUMASERVE_SWEEP_LEVELS`` and
``NUMASERVE_SWEEP_SHAPES`` narrow the sweep to a few points (``_narrowed``).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numaserve.tools.loadtest as lt

from benchlib import engine, procs
from benchlib.common import Ctx, summarize, summarize_rows
from benchlib.scen_overload import OverloadParams, _capacity, _one_level, _unloaded_p50
from benchlib.servers import Server, ServerConfig

PATHS = {"blocking": "/cpu20", "cooperative": "/cpu20y"}
APP = "fastapp:app"
BASE_LABEL = "numaserve-base"
PEERS = ("uvicorn", "gunicorn")

KEYS = ("offered_rps", "goodput_rps", "ok_500ms_rps", "p99_admitted_ms", "shed_new_p99_ms", "shed_p99_ms",
        "shed_frac", "timeout_frac", "other_fail_frac", "cpu_after_s", "idle_wait_s")

#: A process tree is idle while it uses less than this share of one CPU ...
IDLE_CPU = 0.05
#: ... over a window this long (every server's tree at once).
IDLE_WINDOW_S = 0.5


@dataclass
class SweepParams:
    """Issue 32's set-up; quick mode: two levels, short runs."""

    workers: int = 2
    timeout_s: float = 2.0
    levels: tuple[float, ...] = (0.5, 0.9, 1.0, 1.4, 2.0, 3.0)
    shapes: tuple[str, ...] = ("blocking", "cooperative")
    duration_s: float = 8.0
    after_s: float = 2.0           # CPU burnt after the load (reported); then wait for every tree to idle
    capacity_s: float = 4.0
    unloaded_s: float = 1.5
    idle_timeout_s: float = 30.0
    connections: int = 1000

    def level_params(self) -> OverloadParams:
        """What ``scen_overload._one_level`` reads."""
        return OverloadParams(workers=self.workers, timeout_s=self.timeout_s, duration_s=self.duration_s,
                              after_s=self.after_s, connections=self.connections)


def quick_params() -> SweepParams:
    return SweepParams(levels=(0.5, 2.0), duration_s=2.0, after_s=1.0, capacity_s=1.5, unloaded_s=0.5,
                       idle_timeout_s=15.0)


def _narrowed(p: SweepParams, env: Mapping[str, str]) -> SweepParams:
    """An A/B of a few points: ``NUMASERVE_SWEEP_LEVELS=0.9,1`` and ``NUMASERVE_SWEEP_SHAPES=blocking``
    keep only those (the verdicts then judge only what ran)."""
    levels = tuple(float(x) for x in env.get("NUMASERVE_SWEEP_LEVELS", "").split(",") if x.strip())
    shapes = tuple(x.strip() for x in env.get("NUMASERVE_SWEEP_SHAPES", "").split(",") if x.strip())
    bad = [x for x in shapes if x not in PATHS]
    if bad:
        raise ValueError(f"NUMASERVE_SWEEP_SHAPES: unknown shape(s) {bad}; choose from {sorted(PATHS)}")
    return dataclasses.replace(p, levels=levels or p.levels, shapes=shapes or p.shapes)


def _fixed_capacity(env: Mapping[str, str]) -> float | None:
    """``NUMASERVE_SWEEP_CAPACITY``: C in requests/s instead of measuring it (an A/B at the rates of
    an earlier run with the peers; numaserve's closed-loop C counts only 2xx, so its own is low)."""
    raw = env.get("NUMASERVE_SWEEP_CAPACITY", "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"NUMASERVE_SWEEP_CAPACITY: expected requests/s > 0, got {raw!r}")
    return value


def _config(name: str, p: SweepParams, base: str, env: Mapping[str, str] = os.environ) -> ServerConfig:
    """``NUMASERVE_SWEEP_TOML`` (TOML text) is added to this checkout's numaserve config, not to the
    base's: an A/B of a setting against the same code started as ``--base``."""
    if name == BASE_LABEL:
        return ServerConfig("numaserve", workers=p.workers, app=APP, label=BASE_LABEL, checkout=base)
    if name == "numaserve":
        return ServerConfig(name, workers=p.workers, app=APP,
                            numaserve_toml="\n" + env.get("NUMASERVE_SWEEP_TOML", "").replace("\\n", "\n"))
    return ServerConfig(name, workers=p.workers, app=APP)


def _start(cfg: ServerConfig) -> Server:
    srv = Server(cfg).start()
    try:
        srv.wait_ready()
        for path in PATHS.values():   # warm: imports, first-call caches, the gate's CPU per request
            engine.run(lt.LoadConfig(srv.url + path, concurrency=4, duration=0.5, timeout=10.0))
    except BaseException:
        srv.stop()
        raise
    return srv


def wait_idle(servers: dict[str, Server], timeout_s: float) -> tuple[float, list[str]]:
    """Wait until every server's tree uses < ``IDLE_CPU`` of a CPU over one ``IDLE_WINDOW_S``
    window; (seconds waited, names still busy at ``timeout_s``)."""
    t0 = time.monotonic()
    busy: list[str] = list(servers)
    while time.monotonic() - t0 < timeout_s:
        meters = {name: procs.TreeCpu(srv.master_pid).start() for name, srv in servers.items()}
        w0 = time.monotonic()
        time.sleep(IDLE_WINDOW_S)
        dt = time.monotonic() - w0
        busy = [name for name, m in meters.items() if m.sample() / dt >= IDLE_CPU]
        if not busy:
            return round(time.monotonic() - t0, 2), []
    return round(time.monotonic() - t0, 2), busy


def run(ctx: Ctx, p: SweepParams | None = None) -> dict[str, Any]:
    p = p or (quick_params() if ctx.quick else SweepParams())
    p = _narrowed(p, os.environ)
    base = str(ctx.base) if ctx.base else ""
    names = list(ctx.servers) + ([BASE_LABEL] if base else [])
    bad = [n for n in names if n not in ("numaserve", BASE_LABEL, *PEERS)]
    if bad:
        raise ValueError(f"overload-sweep runs numaserve, uvicorn and gunicorn, not {bad}")
    servers: dict[str, Server] = {}
    restarts: dict[str, int] = {}
    raw: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    try:
        for name in names:
            servers[name] = _start(_config(name, p, base))
        # capacity C, first, in this run: closed loop on the cooperative request, median of the servers
        per: dict[str, float] = {}
        fixed = _fixed_capacity(os.environ)
        for name, srv in servers.items():
            if fixed is not None:
                break
            wait_idle(servers, p.idle_timeout_s)
            per[name] = round(_capacity(srv, PATHS["cooperative"], p.capacity_s), 1)
            ctx.log(f"overload-sweep capacity {name:14} {per[name]:.1f} req/s")
        C = fixed if fixed is not None else float(summarize(per.values())["median"])
        unloaded: dict[tuple[str, str], float | None] = {}
        for name, srv in servers.items():
            for shape, path in PATHS.items():
                wait_idle(servers, p.idle_timeout_s)
                unloaded[(name, shape)] = _unloaded_p50(srv, path, p.unloaded_s)
        lp = p.level_params()
        for rep in range(ctx.reps):
            order = ctx.order(rep) + ([BASE_LABEL] if base else [])
            if base:   # the base among the others, not always last
                order.insert(rep % len(order), order.pop())
            for shape in p.shapes:
                for level in p.levels:
                    for name in order:
                        waited, busy = wait_idle(servers, p.idle_timeout_s)
                        for b in busy:   # still burning a backlog: start it clean
                            ctx.log(f"overload-sweep {b} still busy after {waited:.0f} s: restarted")
                            servers[b].stop()
                            servers[b] = _start(_config(b, p, base))
                            restarts[b] = restarts.get(b, 0) + 1
                        srv = servers[name]
                        row = _one_level(srv, lp, PATHS[shape], level * C, C, unloaded[(name, shape)])
                        row.pop("timeline", None)
                        row.pop("limits_seen", None)
                        row["idle_wait_s"] = waited
                        row["level"] = level
                        raw.setdefault((shape, level, name), []).append(row)
                        ctx.log(f"overload-sweep rep {rep + 1} {shape:11} {level:g}x {name:14} "
                                f"ok {row['goodput_rps']:6.1f}/s <500ms {row['ok_500ms_rps']:6.1f}/s "
                                f"p99 {row['p99_admitted_ms']} ms 503new-p99 {row['shed_new_p99_ms']} ms "
                                f"shed {row['shed_frac']} timeouts {row['timeout_frac']}")
    finally:
        for srv in servers.values():
            srv.stop()
    rows = [{"shape": shape, "level": level, "server": name, "reps": reps, **summarize_rows(reps, KEYS)}
            for (shape, level, name), reps in raw.items()]
    rows.sort(key=lambda r: (p.shapes.index(r["shape"]), r["level"], names.index(r["server"])))
    return {
        "title": "Overload sweep (issue 32: 0.5x to 3x capacity, open loop, FastAPI)",
        "params": {"app": APP, "workers": p.workers, "client_timeout_s": p.timeout_s, "duration_s": p.duration_s,
                   "levels": list(p.levels), "paths": PATHS, "connections": p.connections, "reps": ctx.reps,
                   "servers": names, "base_checkout": base or None,
                   "idle": f"< {IDLE_CPU:.0%} of a CPU over {IDLE_WINDOW_S} s, every server, before each run"},
        "capacity": {"per_server": per, "common_rps": C},
        "unloaded_p50_ms": {f"{n}/{s}": v for (n, s), v in unloaded.items()},
        "restarts": restarts,
        "rows": rows,
        "verdicts": verdicts(rows),
    }


def _med(rows: list[dict[str, Any]], shape: str, level: float, server: str, key: str) -> float | None:
    for r in rows:
        if r["shape"] == shape and r["level"] == level and r["server"] == server:
            v = r[key]["median"]
            return None if v is None else float(v)
    return None


def verdicts(rows: list[dict[str, Any]], server: str = "numaserve") -> list[dict[str, Any]]:
    """One line per done-when criterion of issue 32 and shape, on medians over repetitions.

    ``met`` is None when a number it needs is missing (e.g. no 503 at all: the 503 criterion
    holds vacuously and says so).  "Below 0.9× capacity" includes 0.9 (the stricter reading).
    """
    out: list[dict[str, Any]] = []
    for shape in sorted({r["shape"] for r in rows}):
        levels = sorted({r["level"] for r in rows if r["shape"] == shape})
        peers = sorted({r["server"] for r in rows if r["shape"] == shape and r["server"] in PEERS})

        def m(level: float, key: str, who: str = server) -> float | None:
            return _med(rows, shape, level, who, key)

        def line(criterion: str, checked: list[tuple[float, bool | None, str]]) -> None:
            known = [c for c in checked if c[1] is not None]
            met = None if not known else all(c[1] for c in known)
            failed = [f"{lv:g}x: {txt}" for lv, ok, txt in checked if ok is False]
            out.append({"shape": shape, "criterion": criterion, "met": met,
                        "detail": "; ".join(failed) if failed else
                        ", ".join(f"{lv:g}x {txt}" for lv, _ok, txt in checked) or "no load in range"})

        low = [lv for lv in levels if lv <= 0.9]
        high = [lv for lv in levels if 1.0 <= lv <= 3.0]
        chk: list[tuple[float, bool | None, str]] = []
        for lv in low:
            s = m(lv, "shed_frac")
            chk.append((lv, None if s is None else s <= 0.005, f"shed {s if s is None else f'{s:.1%}'}"))
        line("below 0.9 C: <= 0.5 % shed", chk)
        chk = []
        for lv in low:
            mine = m(lv, "p99_admitted_ms")
            best = min((x for x in (m(lv, "p99_admitted_ms", k) for k in peers) if x is not None), default=None)
            ok = None if mine is None or best is None else mine <= 2 * best
            chk.append((lv, ok, f"p99 {mine} ms vs best peer {best} ms"))
        line("below 0.9 C: p99 <= 2x the best peer's", chk)
        peak = max((x for x in (m(lv, "goodput_rps") for lv in levels) if x is not None), default=None)
        chk = []
        for lv in high:
            g = m(lv, "goodput_rps")
            ok = None if g is None or peak is None else g >= 0.9 * peak
            chk.append((lv, ok, f"{g} ok/s (peak {peak})"))
        line("1-3 C: ok/s >= 0.9 x own peak", chk)
        chk = []
        for lv in high:
            g = m(lv, "ok_500ms_rps")
            best = max((x for x in (m(lv, "ok_500ms_rps", k) for k in peers) if x is not None), default=None)
            ok = None if g is None or best is None else g >= best
            chk.append((lv, ok, f"{g}/s within 500 ms vs best peer {best}/s"))
        line("1-3 C: 2xx within 500 ms >= every peer's", chk)
        chk = []
        for lv in high:
            t = m(lv, "timeout_frac")
            chk.append((lv, None if t is None else t == 0, f"timeouts {t}"))
        line("1-3 C: 0 client timeouts", chk)
        chk = []
        for lv in high:
            v = m(lv, "p99_admitted_ms")
            chk.append((lv, None if v is None else v <= 250, f"admitted p99 {v} ms"))
        line("1-3 C: admitted p99 <= 250 ms", chk)
        chk = []
        for lv in high:
            v = m(lv, "shed_new_p99_ms")
            chk.append((lv, None if v is None else v <= 50, f"503 new-conn p99 {v} ms"))
        line("1-3 C: 503 on new connections p99 <= 50 ms", chk)
    return out
