"""PNG plots (matplotlib, Agg backend): one figure per scenario, servers in
fixed colours, error bars = min–max over repetitions."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

COLORS = {"numaserve": "#1b9e77", "uvicorn": "#d95f02", "gunicorn": "#7570b3",
          "numaserve-numa": "#1b9e77", "numaserve-hash": "#66c2a5"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _color(name: str) -> str:
    for k, v in COLORS.items():
        if name == k:
            return v
    for k, v in COLORS.items():
        if name.startswith(k):
            return v
    return "#888888"


def _servers(rows: list[dict[str, Any]]) -> list[str]:
    order = ("numaserve", "uvicorn", "gunicorn")
    names = sorted({r["server"] for r in rows}, key=lambda n: (next((i for i, o in enumerate(order)
                                                                     if n.startswith(o)), 9), n))
    return names


def _bars(ax: Any, groups: list[str], servers: list[str], get: Callable[[str, str], dict[str, Any] | None],
          ylabel: str) -> None:
    width = 0.8 / max(1, len(servers))
    for i, srv in enumerate(servers):
        xs, ys, lo, hi = [], [], [], []
        for j, g in enumerate(groups):
            s = get(g, srv)
            if not s or s.get("median") is None:
                continue
            xs.append(j + (i - (len(servers) - 1) / 2) * width)
            ys.append(s["median"])
            lo.append(s["median"] - s["min"])
            hi.append(s["max"] - s["median"])
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=srv, color=_color(srv))
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def plot_throughput(s: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    rows = s["rows"]
    servers = _servers(rows)
    groups = sorted({f"{r['variant']}/{r['placement']}" for r in rows}, key=lambda g: (g.split("/")[1] != "shared", g))

    def get(key: str) -> Callable[[str, str], dict[str, Any] | None]:
        def f(g: str, srv: str) -> dict[str, Any] | None:
            v, pl = g.split("/")
            return next((r[key] for r in rows if r["variant"] == v and r["placement"] == pl and r["server"] == srv),
                        None)
        return f

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    _bars(axes[0], groups, servers, get("rps"), "requests/s")
    axes[0].set_title("throughput (closed loop)")
    axes[0].set_yscale("log")
    _bars(axes[1], groups, servers, get("p50_ms"), "ms")
    axes[1].set_title("p50 latency")
    _bars(axes[2], groups, servers, get("p99_ms"), "ms")
    axes[2].set_title("p99 latency")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path = out / "throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_overload(s: dict[str, Any], out: Path) -> list[Path]:
    plt = _plt()
    paths = []
    cap = s["capacity"]["common_rps"]
    for shape in sorted({r["shape"] for r in s["rows"]}, key=lambda x: x != "cooperative"):
        rows = [r for r in s["rows"] if r["shape"] == shape]
        servers = _servers(rows)
        fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
        panels = [("slo_goodput_rps", "SLO goodput (req/s)", False), ("p99_admitted_ms", "p99 of 2xx (ms)", True),
                  ("shed_frac", "shed (503) fraction", False), ("timeout_frac", "client timeout fraction", False)]
        for ax, (key, title, log) in zip(axes, panels):
            for srv in servers:
                pts = sorted((r["level"], r[key]) for r in rows if r["server"] == srv and r[key]["median"] is not None)
                if not pts:
                    continue
                xs = [p[0] for p in pts]
                ys = [p[1]["median"] for p in pts]
                err = [[p[1]["median"] - p[1]["min"] for p in pts], [p[1]["max"] - p[1]["median"] for p in pts]]
                ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=srv, color=_color(srv))
            if key == "slo_goodput_rps":
                ax.axhline(0.85 * cap, ls="--", color="grey", lw=0.8)
                ax.text(min(r["level"] for r in rows), 0.85 * cap, " 0.85 × capacity", fontsize=7, va="bottom")
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("offered load (× capacity)")
            ax.set_xticks(sorted({r["level"] for r in rows}))
            if log:
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"overload, {shape} 20 ms request, capacity {cap:.0f} req/s, 2 s client timeout", fontsize=10)
        fig.tight_layout()
        path = out / f"overload_{shape}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    # time line of the first repetition at the highest cooperative level ≥ 2
    lv = max((r["level"] for r in s["rows"] if r["shape"] == "cooperative"), default=None)
    if lv is not None:
        rows = [r for r in s["rows"] if r["shape"] == "cooperative" and r["level"] == lv]
        fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.4), sharey=True, squeeze=False)
        for ax, r in zip(axes[0], sorted(rows, key=lambda r: _servers(rows).index(r["server"]))):
            tl = r["reps"][0]["timeline"]
            for what, color in (("2xx", "#1b9e77"), ("503", "#e6ab02"), ("error", "#e7298a")):
                pts = tl.get(what) or []
                if pts:
                    xs, ys = _rebin(pts, 5)
                    ax.plot(xs, ys, label={"error": "timeouts/errors"}.get(what, what), color=color)
            ax.set_title(f"{r['server']} at {lv:g}×", fontsize=10)
            ax.set_xlabel("s since start")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("per second")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        path = out / "overload_timeline.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_overload_sweep(s: dict[str, Any], out: Path) -> Path:
    """ok/s and admitted p99 against offered load, one row per request shape."""
    plt = _plt()
    shapes = sorted({r["shape"] for r in s["rows"]})
    cap = s["capacity"]["common_rps"]
    fig, axes = plt.subplots(len(shapes), 2, figsize=(11, 3.6 * len(shapes)), squeeze=False)
    for row_axes, shape in zip(axes, shapes):
        rows = [r for r in s["rows"] if r["shape"] == shape]
        for ax, (key, title, log) in zip(row_axes, (("goodput_rps", "ok/s", False),
                                                    ("p99_admitted_ms", "p99 of 2xx (ms)", True))):
            for srv in _servers(rows):
                pts = sorted((r["level"], r[key]) for r in rows if r["server"] == srv and r[key]["median"] is not None)
                if not pts:
                    continue
                err = [[q[1]["median"] - q[1]["min"] for q in pts], [q[1]["max"] - q[1]["median"] for q in pts]]
                ax.errorbar([q[0] for q in pts], [q[1]["median"] for q in pts], yerr=err, marker="o", capsize=3,
                            label=srv, color=_color(srv), ls="--" if srv.endswith("-base") else "-")
            ax.set_title(f"{shape}: {title}", fontsize=10)
            ax.set_xlabel("offered load (× capacity)")
            ax.set_xticks(sorted({r["level"] for r in rows}))
            if log:
                ax.set_yscale("log")
                ax.axhline(250, ls=":", color="grey", lw=0.8)
            else:
                ax.axhline(cap, ls=":", color="grey", lw=0.8)
            ax.grid(alpha=0.3)
        row_axes[0].legend(fontsize=8)
    fig.suptitle(f"overload sweep, FastAPI, 2 workers, 20 ms requests, C = {cap:.0f} req/s, 2 s client timeout",
                 fontsize=10)
    fig.tight_layout()
    path = out / "overload_sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _rebin(pts: list[Any], k: int) -> tuple[list[float], list[float]]:
    """Merge k time-line buckets (0.1 s) into one and convert to a per-second rate."""
    xs, ys = [], []
    for i in range(0, len(pts) - k + 1, k):
        xs.append(pts[i][0])
        ys.append(sum(c for _, c in pts[i:i + k]) / (k * 0.1))
    return xs, ys


def plot_resilience(s: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    tls = s["timelines"]
    servers = _servers([{"server": k} for k in tls])
    fig, axes = plt.subplots(len(servers), 1, figsize=(10, 2.4 * len(servers)), sharex=True, squeeze=False)
    for ax, srv in zip(axes[:, 0], servers):
        tl = tls[srv]
        xs = [t for t, _ in tl["rps"]]
        ys = [v for _, v in tl["rps"]]
        ax.step(xs, ys, where="post", color=_color(srv), label="2xx/s (0.5 s windows)")
        for key, label, style in (("t_reload", "reload", "--"), ("t_reload_done", "reload done", ":"),
                                  ("t_kill", "kill -9", "--"), ("t_replaced", "replaced", ":")):
            if tl.get(key) is not None:
                ax.axvline(tl[key], ls=style, color="black" if "kill" in key or "replaced" in key else "grey", lw=1)
                ax.text(tl[key], ax.get_ylim()[1] * 0.92, " " + label, fontsize=7)
        errs = tl.get("errors") or []
        if errs:
            ax.scatter([t for t, _ in errs], [0] * len(errs), marker="x", color="red", label="failed")
        ax.set_ylabel(srv)
        ax.grid(alpha=0.3)
    return _save_timelines(plt, fig, axes, "reload then kill -9 of the busiest worker, under closed-loop load "
                           "(first repetition)", out / "resilience_timeline.png")


def _save_timelines(plt: Any, fig: Any, axes: Any, title: str, path: Path) -> Path:
    axes[0, 0].set_title(title, fontsize=10)
    axes[-1, 0].set_xlabel("s since start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_storm(s: dict[str, Any], out: Path) -> Path | None:
    """Kill storm and SIGSTOP runs, per server (first repetition); None without them."""
    tls = s.get("storm_timelines") or {}
    if not tls:
        return None
    plt = _plt()
    keys = sorted(tls, key=lambda k: (k.split(" ", 1)[0] != "storm", _servers([{"server": k.split(" ", 1)[1]}])[0]))
    fig, axes = plt.subplots(len(keys), 1, figsize=(10, 1.9 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        ev, srv = key.split(" ", 1)
        tl = tls[key]
        ax.step([t for t, _ in tl["rps"]], [v for _, v in tl["rps"]], where="post", color=_color(srv),
                label="2xx/s (0.5 s windows)")
        if ev == "storm":
            ax.axvspan(tl["t_event"], tl["t_event_end"], color="red", alpha=0.12, lw=0)
        else:
            ax.axvline(tl["t_event"], ls="--", color="black", lw=1)
        for k, marker, color in (("errors", "x", "red"), ("slow", "|", "orange")):
            pts = tl.get(k) or []
            if pts:
                ax.scatter([t for t, _ in pts], [0] * len(pts), marker=marker, color=color,
                           label="failed" if k == "errors" else "answered after > 1 s")
        ax.set_ylabel(f"{srv}\n{'10 × kill -9' if ev == 'storm' else 'SIGSTOP'}", fontsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, loc="lower right")
    return _save_timelines(plt, fig, axes, "kill storm (shaded) and a frozen worker (dashed) under closed-loop "
                           "load, first repetition", out / "resilience_storm.png")


def plot_balance(s: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    rows = s["rows"]
    servers = _servers(rows)
    groups = sorted({r["variant"] for r in rows})
    _bars(axes[0], groups, servers,
          lambda g, srv: next((r["busiest_share"] for r in rows if r["variant"] == g and r["server"] == srv), None),
          "busiest worker's share (0.5 = even)")
    axes[0].axhline(0.5, ls="--", color="grey", lw=0.8)
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(fontsize=8)
    axes[0].set_title("requests per worker, 2 workers", fontsize=10)
    loc = s["locality"]
    names = _servers(loc)
    meds = [next(r["local_share"] for r in loc if r["server"] == n) for n in names]
    axes[1].bar(range(len(names)), [m["median"] or 0 for m in meds], color=[_color(n) for n in names],
                yerr=[[(m["median"] or 0) - (m["min"] or 0) for m in meds], [(m["max"] or 0) - (m["median"] or 0)
                                                                           for m in meds]], capsize=3)
    axes[1].set_xticks(range(len(names)))
    axes[1].set_xticklabels([n.replace(" --", "\n--") for n in names], fontsize=8)
    axes[1].set_ylim(0, 1.05)
    axes[1].axhline(0.5, ls="--", color="grey", lw=0.8)
    axes[1].set_title("share served on the receiving CPU's (pretend) node", fontsize=10)
    fig.tight_layout()
    path = out / "balance.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_overhead_startup(over: dict[str, Any] | None, start: dict[str, Any] | None, out: Path) -> Path | None:
    if over is None and start is None:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    if over is not None:
        rows = sorted(over["rows"], key=lambda r: _servers(over["rows"]).index(r["server"]))
        names = [r["server"] for r in rows]
        x = range(len(names))
        idle = [r["supervisor_idle_cpu_pct_summary"]["median"] or 0 for r in rows]
        load = [r["supervisor_load_cpu_pct"] or 0 for r in rows]
        axes[0].bar([i - 0.2 for i in x], idle, 0.4, label="idle", color=[_color(n) for n in names], alpha=0.6)
        axes[0].bar([i + 0.2 for i in x], load, 0.4, label="under load", color=[_color(n) for n in names])
        axes[0].set_xticks(list(x))
        axes[0].set_xticklabels(names, fontsize=8)
        axes[0].set_ylabel("% of one CPU")
        axes[0].set_title(f"supervisor/master CPU, {rows[0]['workers']} workers (light: idle)", fontsize=10)
        axes[1].bar(list(x), [r["all_ready_s"] for r in rows], color=[_color(n) for n in names])
        axes[1].set_xticks(list(x))
        axes[1].set_xticklabels(names, fontsize=8)
        axes[1].set_ylabel("s")
        axes[1].set_title(f"start-up of {rows[0]['workers']} workers to all ready", fontsize=10)
    if start is not None:
        rows = start["rows"]
        servers = _servers(rows)
        _bars(axes[2], ["first_answer_s", "all_ready_s"], servers,
              lambda g, srv: next((r[g] for r in rows if r["server"] == srv), None), "s")
        axes[2].set_title("start-up, 2 workers", fontsize=10)
        axes[2].legend(fontsize=8)
    fig.tight_layout()
    path = out / "overhead_startup.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(results: dict[str, Any], out: Path) -> list[str]:
    sc = results["scenarios"]
    made: list[Path] = []
    ok = {k: v for k, v in sc.items() if "error" not in v}
    if "throughput" in ok:
        made.append(plot_throughput(ok["throughput"], out))
    if "overload" in ok:
        made += plot_overload(ok["overload"], out)
    if "overload-sweep" in ok:
        made.append(plot_overload_sweep(ok["overload-sweep"], out))
    if "resilience" in ok:
        made.append(plot_resilience(ok["resilience"], out))
        storm = plot_storm(ok["resilience"], out)
        if storm is not None:
            made.append(storm)
    if "balance" in ok:
        made.append(plot_balance(ok["balance"], out))
    p = plot_overhead_startup(ok.get("overhead"), ok.get("startup"), out)
    if p is not None:
        made.append(p)
    return [m.name for m in made]
