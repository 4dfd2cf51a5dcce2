"""Results as JSON and markdown tables (one table per scenario; medians with
the min–max spread over repetitions in brackets)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchlib.common import fmt

SERVER_ORDER = ("numaserve", "uvicorn", "gunicorn", "granian")


def _srv_key(name: str) -> tuple[int, str]:
    for i, s in enumerate(SERVER_ORDER):
        if name.startswith(s):
            return i, name
    return len(SERVER_ORDER), name


def write_json(results: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(results, indent=1, sort_keys=False, default=str) + "\n")


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def md_throughput(s: dict[str, Any]) -> list[str]:
    rows = sorted(s["rows"], key=lambda r: (r["placement"] != "shared", r["variant"], _srv_key(r["server"])))
    return _table(
        ["placement", "request", "server", "req/s", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms",
         "server CPU µs/req", "failed"],
        [[r["placement"], r["variant"], r["server"], fmt(r["rps"], 0), fmt(r["p50_ms"], 2), fmt(r["p90_ms"], 2),
          fmt(r["p99_ms"], 2), fmt(r["p999_ms"], 1), fmt(r["server_cpu_us_per_req"], 0),
          fmt(r["failed"], 0, spread=False)] for r in rows])


def md_overload(s: dict[str, Any]) -> list[str]:
    cap = s["capacity"]
    own = cap.get("own_closed_loop_rps") or {}
    lines = [f"Common capacity C = **{cap['common_rps']:.1f} req/s** (median of "
             + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cap["per_server"].items(), key=lambda kv: _srv_key(kv[0])))
             + ("; each server's own closed-loop rate during the repetitions: "
                + ", ".join(f"{k} {fmt(v)}" for k, v in sorted(own.items(), key=lambda kv: _srv_key(kv[0])))
                if own else "") + ").",
             ""]
    rows = sorted(s["rows"], key=lambda r: (r["shape"] != "cooperative", r["level"], _srv_key(r["server"])))
    lines += _table(
        ["request", "load", "server", "offered/s", "goodput/s", "SLO goodput/s", "SLO goodput ÷ C",
         "p99 admitted ms", "÷ unloaded p50", "shed", "503 p99 ms", "timeouts", "CPU-s after"],
        [[r["shape"], f"{r['level']:g}×", r["server"], fmt(r["offered_rps"], 0, spread=False),
          fmt(r["goodput_rps"]), fmt(r["slo_goodput_rps"]), fmt(r["slo_goodput_x_capacity"], 2),
          fmt(r["p99_admitted_ms"], 0), fmt(r["p99_over_unloaded_p50"], 1), _pct(r["shed_frac"]),
          fmt(r["shed_p99_ms"], 0), _pct(r["timeout_frac"]), fmt(r["cpu_after_s"], 1)] for r in rows])
    if s.get("targets"):
        lines += ["", "Issue-13 targets for numaserve (medians):", ""]
        lines += _table(["request", "load", "target", "wanted", "measured", "met"],
                        [[t["shape"], f"{t['level']:g}×", t["target"], t["wanted"],
                          "–" if t["measured"] is None else str(t["measured"]),
                          {True: "yes", False: "**no**", None: "–"}[t["met"]]] for t in s["targets"]])
    return lines


def _pct(s: dict[str, Any] | None) -> str:
    if not s or s.get("median") is None:
        return "–"
    med = f"{100 * s['median']:.0f} %"
    if s["n"] >= 2 and s["min"] != s["max"]:
        return f"{med} ({100 * s['min']:.0f}–{100 * s['max']:.0f})"
    return med


def md_resilience(s: dict[str, Any]) -> list[str]:
    rows = sorted(s["rows"], key=lambda r: (r["event"] != "reload", _srv_key(r["server"])))
    return _table(
        ["event", "server", "baseline req/s", "failed requests", "connection errors", "error responses",
         "worst 0.5 s ÷ baseline", "time to full capacity s", "server done s"],
        [[r["event"], r["server"], fmt(r["baseline_rps"], 0), fmt(r["failed"], 0), fmt(r["connection_errors"], 0),
          fmt(r["error_responses"], 0), fmt(r["worst_window_x_baseline"], 2), _recovery(r),
          fmt(r["done_s"], 2)] for r in rows]) + md_storm(s)


def md_storm(s: dict[str, Any]) -> list[str]:
    """Kill storm and frozen worker (full mode): one table, both events."""
    rows = sorted(s.get("storm_rows") or [], key=lambda r: (r["event"] != "storm", _srv_key(r["server"])))
    if not rows:
        return []

    def yes(r: dict[str, Any], key: str) -> str:
        vals = [x.get(key) for x in r["reps"] if x.get(key) is not None]
        return "–" if not vals else f"{sum(1 for v in vals if v)}/{len(vals)}"

    lines = ["", f"Kill storm ({s['params'].get('storm', '')}) and frozen worker ({s['params'].get('freeze', '')}); "
             f"delayed = {s['params'].get('delayed', '')}:", ""]
    lines += _table(
        ["event", "server", "kills", "failed requests", "delayed requests", "requests in window", "still up",
         "every worker serving again", "recovered after s", "frozen worker replaced after s"],
        [[{"storm": "kill storm", "freeze": "SIGSTOP"}.get(r["event"], r["event"]), r["server"],
          fmt(r["kills"], 0), fmt(r["failed"], 0), fmt(r["delayed"], 0), fmt(r["requests"], 0), yes(r, "alive"),
          yes(r, "all_serving") if r["event"] == "storm" else "–", fmt(r["recovered_s"], 2),
          fmt(r["replaced_s"], 2) if r["event"] == "freeze" else "–"] for r in rows])
    return lines


def _recovery(r: dict[str, Any]) -> str:
    cell = fmt(r["time_to_full_capacity_s"], 2)
    stuck = sum(1 for x in r["reps"] if not x.get("recovered", True))
    return cell + (f"; not back by the end in {stuck} of {len(r['reps'])}" if stuck else "")


def md_balance(s: dict[str, Any]) -> list[str]:
    rows = sorted(s["rows"], key=lambda r: (r["variant"], _srv_key(r["server"])))
    lines = _table(["connections", "server", "busiest worker's share", "idlest worker's share", "req/s"],
                   [[r["variant"], r["server"], fmt(r["busiest_share"], 2), fmt(r["idlest_share"], 2),
                     fmt(r["rps"], 0)] for r in rows])
    lines += ["", "Share of requests served on the client's (receiving) CPU = pretend node:", ""]
    lines += _table(["server", "share on the receiving node", "req/s"],
                    [[r["server"], fmt(r["local_share"], 2), fmt(r["rps"], 0)]
                     for r in sorted(s["locality"], key=lambda r: _srv_key(r["server"]))])
    return lines


def md_overhead(s: dict[str, Any]) -> list[str]:
    rows = sorted(s["rows"], key=lambda r: _srv_key(r["server"]))
    return _table(
        ["server", "workers", "all ready s", "supervisor CPU idle %", "supervisor CPU under load %",
         "tree CPU idle %", "tree RSS MB", "req/s under load", "ratelimit set, all acked: p50 / p99 ms",
         "of which the fan-out (sent → last Ack): p99 ms"],
        [[r["server"], str(r["workers"]), f"{r['all_ready_s']:.2f}", fmt(r["supervisor_idle_cpu_pct_summary"], 2),
          "–" if r["supervisor_load_cpu_pct"] is None else f"{r['supervisor_load_cpu_pct']:.2f}",
          f"{r['tree_idle_cpu_pct']:.2f}", f"{r['tree_rss_mb']:.0f}", f"{r['load_rps']:.0f}",
          (f"{1000 * r['control_latency_summary']['median']:.1f} / {r.get('control_p99_ms')}"
           if r["control_latency_s"] and r["control_latency_summary"].get("median") is not None
           else "n/a (no runtime channel)"),
          "–" if r.get("control_fanout_p99_ms") is None else f"{r['control_fanout_p99_ms']}"]
         for r in rows])


def md_admission(s: dict[str, Any]) -> list[str]:
    rows = sorted(s["rows"], key=lambda r: (r["case"], _srv_key(r["server"])))
    return _table(["case", "server", "served", "refused (503)", "other"],
                  [[r["case"], r["server"], f"{r['served']}/{r['sent']}", str(r["refused_503"]),
                    ", ".join(f"{k}: {v}" for k, v in r["other"].items()) or "–"] for r in rows])


def md_startup(s: dict[str, Any]) -> list[str]:
    rows = sorted(s["rows"], key=lambda r: _srv_key(r["server"]))
    return _table(["server", "first answer s", "all workers ready s"],
                  [[r["server"], fmt(r["first_answer_s"], 2), fmt(r["all_ready_s"], 2)] for r in rows])


def md_hotpath(s: dict[str, Any]) -> list[str]:
    rows = sorted(s["rows"], key=lambda r: (r["variant"], r["placement"], _srv_key(r["server"])))
    out = _table(
        ["request", "placement", "server", "req/s", "server CPU µs/req", "server CPU µs/chunk", "failed"],
        [[r["variant"], r["placement"], r["server"], fmt(r["rps"], 0), fmt(r["server_cpu_us_per_req"], 1),
          fmt(r["server_cpu_us_per_chunk"], 2), fmt(r["failed"], 0, spread=False)] for r in rows])
    idle = s.get("supervisor_idle") or {}
    if idle:
        out += ["", f"Supervisor idle CPU with {idle['workers']} workers: {idle['supervisor_idle_cpu_pct']} % of a CPU "
                    f"({idle['supervisor_cpu_s']} s over {idle['window_s']} s)."]
    return out


def md_warm(s: dict[str, Any]) -> list[str]:
    rows = sorted(s["rows"], key=lambda r: _srv_key(r["server"]))
    sizes = s.get("params", {}).get("sizes", [8])
    head = ["server", "kill -9 → replacement serving s", "reload 2 slots: done s", "reload failed",
            "reload worst 0.5 s window × baseline"]
    for w in sizes:
        head += [f"{w} workers: all ready s", f"{w} workers: tree PSS MB", f"{w} workers: tree RSS MB"]
    out = []
    for r in rows:
        cells = [r["server"], fmt(r["kill_to_serving_s"], 3), fmt(r["reload_done_s"], 2), fmt(r["reload_failed"], 0),
                 fmt(r["reload_worst_window"], 2)]
        for w in sizes:
            m = r.get(f"w{w}") or {}
            cells += [fmt(m.get("all_ready_s"), 2), fmt(m.get("tree_pss_mb"), 0), fmt(m.get("tree_rss_mb"), 0)]
        out.append(cells)
    return _table(head, out)


RENDER = {"warm": md_warm, "hotpath": md_hotpath, "throughput": md_throughput, "overload": md_overload, "resilience": md_resilience,
          "balance": md_balance, "overhead": md_overhead, "admission": md_admission, "startup": md_startup}


def md_model(s: dict[str, Any]) -> list[str]:
    rows = sorted(s["rows"], key=lambda r: _srv_key(r["server"]))
    head = ["server", "load to ready s", "tree PSS MB (2 workers)"]
    for c in s["params"]["concurrency"]:
        head += [f"{c} streams: tok/s", f"{c}: TTFT p50 ms", f"{c}: TTFT p99 ms", f"{c}: failed"]
    out = []
    for r in rows:
        cells = [r["server"], fmt(r["all_ready_s"], 2), fmt(r["tree_pss_mb"], 0)]
        for c in s["params"]["concurrency"]:
            m = r.get(f"c{c}") or {}
            cells += [fmt(m.get("tokens_per_s"), 1), fmt(m.get("ttft_p50_ms"), 0), fmt(m.get("ttft_p99_ms"), 0),
                      fmt(m.get("failed"), 0, spread=False)]
        out.append(cells)
    lines = _table(head, out)
    workers = sorted({m["workers"] for m in s["memory"]})
    servers = sorted({m["server"] for m in s["memory"]}, key=_srv_key)
    by = {(m["server"], m["workers"]): m for m in s["memory"]}
    lines += ["", f"Tree PSS MB with a {s['params']['mem_weights_mb']:.0f} MiB model (load to ready s in brackets):", ""]
    lines += _table(["server"] + [f"{w} workers" for w in workers],
                    [[k] + [f"{by[(k, w)]['tree_pss_mb']:.0f} ({by[(k, w)]['all_ready_s']:.1f})" if (k, w) in by
                            else "–" for w in workers] for k in servers])
    t = s.get("target") or {}
    if t.get("four_workers"):
        lines += ["", f"Target, 4 workers: tree PSS <= {t['four_workers_limit_mb']:.0f} MB: " + ", ".join(
            f"{k} {v['tree_pss_mb']:.0f} MB {'met' if v['met'] else 'MISSED'}"
            for k, v in sorted(t["four_workers"].items(), key=lambda kv: _srv_key(kv[0])))]
    return lines


RENDER["model"] = md_model


def md_overload_sweep(s: dict[str, Any]) -> list[str]:
    cap = s["capacity"]
    lines = [f"Capacity C = **{cap['common_rps']:.1f} req/s** (median of "
             + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cap["per_server"].items(), key=lambda kv: _srv_key(kv[0])))
             + "; closed loop on the cooperative request, measured first in this run)."
             + (f" Restarted for still burning CPU: {s['restarts']}." if s.get("restarts") else ""), ""]
    rows = sorted(s["rows"], key=lambda r: (r["shape"], r["level"], _srv_key(r["server"])))
    lines += _table(
        ["request", "load", "server", "offered/s", "ok/s", "2xx ≤ 500 ms /s", "admitted p99 ms",
         "503 new-conn p99 ms", "shed", "timeouts"],
        [[r["shape"], f"{r['level']:g}×", r["server"], fmt(r["offered_rps"], 0, spread=False), fmt(r["goodput_rps"]),
          fmt(r["ok_500ms_rps"]), fmt(r["p99_admitted_ms"], 0), fmt(r["shed_new_p99_ms"], 0), _pct(r["shed_frac"]),
          _pct(r["timeout_frac"])] for r in rows])
    lines += ["", "Issue-32 done-when, numaserve (medians):", ""]
    lines += [f"- {v['shape']}: {v['criterion']}: {({True: 'MET', False: 'NOT MET', None: 'no data'})[v['met']]}"
              f" ({v['detail']})" for v in s["verdicts"]]
    return lines


RENDER["overload-sweep"] = md_overload_sweep


def write_markdown(results: dict[str, Any], path: Path) -> None:
    meta = results["meta"]
    m = meta["machine"]
    lines = [f"# numaserve benchmark results ({'quick' if meta['quick'] else 'full'} mode)", "",
             f"Run {m['date_utc']} on {m['nproc']} CPUs ({m['cpu_model']}), kernel {m['kernel']}, "
             f"Python {m['python']}, load average at start {m['loadavg_at_start']}, at end "
             f"{meta.get('loadavg_at_end')}; {meta['reps']} repetition(s); took {meta['elapsed_s']:.0f} s. "
             f"Packages: " + ", ".join(f"{k} {v}" for k, v in m["packages"].items() if v) + "; gunicorn worker "
             f"class `{meta['peers']['gunicorn_worker_class']}`. Cells: median (min–max over repetitions).", ""]
    for name, scen in results["scenarios"].items():
        lines += [f"## {scen.get('title', name)}", ""]
        if "error" in scen:
            lines += [f"Not measured: {scen['error']}", ""]
            continue
        p = scen.get("params", {})
        lines += ["Parameters: " + "; ".join(f"{k} = {v}" for k, v in p.items()), ""]
        lines += RENDER[name](scen) + [""]
    path.write_text("\n".join(lines) + "\n")


def write_overload_md(scen: dict[str, Any], meta: dict[str, Any], path: Path) -> None:
    """The issue-10 table on its own (what ``scripts/bench_overload.py`` writes)."""
    m = meta["machine"]
    lines = ["# Overload: numaserve vs uvicorn --workers 2 vs gunicorn + UvicornWorker", "",
             f"{m['date_utc']}, {m['nproc']} CPUs, kernel {m['kernel']}, Python {m['python']}, "
             f"load average {m['loadavg_at_start']} → {meta.get('loadavg_at_end')}; {meta['reps']} repetition(s). "
             "Parameters: " + "; ".join(f"{k} = {v}" for k, v in scen["params"].items()), ""]
    lines += md_overload(scen)
    path.write_text("\n".join(lines) + "\n")
