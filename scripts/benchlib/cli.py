"""``scripts/bench``: run every scenario on numaserve, uvicorn and gunicorn side
by side and write results.json, results.md and PNG plots."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from benchlib import env
from benchlib.common import Ctx

SCENARIOS = ("throughput", "hotpath", "overload", "admission", "resilience", "balance", "overhead", "startup", "warm",
             "model", "overload-sweep")
#: What runs without --scenarios ("hotpath" adds granian and wrk and 32-worker runs: asked for by name;
#: "overload-sweep" takes ~10 min a repetition, its --quick ~2 min).
DEFAULT_SCENARIOS = tuple(s for s in SCENARIOS if s not in ("hotpath", "warm", "model", "overload-sweep"))


def _runner(name: str) -> Callable[[Ctx], dict[str, Any]]:
    import importlib

    mod = importlib.import_module(f"benchlib.scen_{name.replace('-', '_')}")
    return mod.run  # type: ignore[no-any-return]


def _on_term(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)   # unwinds through every Server's finally: nothing left running


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="scripts/bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="CI size: every scenario, short runs, 1 repetition (< 3 min)")
    ap.add_argument("--out", type=Path, default=env.DOCS, help=f"output directory (default {env.DOCS})")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 1 quick, 3 full)")
    ap.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS),
                    help=f"comma-separated subset of {','.join(SCENARIOS)} (default: all but hotpath, warm, model and overload-sweep)")
    ap.add_argument("--servers", default="numaserve,uvicorn,gunicorn", help="comma-separated subset")
    ap.add_argument("--no-install", action="store_true", help="fail instead of pip-installing missing peers")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--seed", type=int, default=1, help="seed of the per-repetition server order")
    ap.add_argument("--base", type=Path, default=None,
                    help="overload-sweep: also run numaserve from this source tree as numaserve-base (before/after)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    names = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    bad = [n for n in names if n not in SCENARIOS]
    if bad:
        print(f"bench: unknown scenario(s) {bad}; choose from {SCENARIOS}", file=sys.stderr)
        return 2
    servers = tuple(s.strip() for s in a.servers.split(",") if s.strip())
    signal.signal(signal.SIGTERM, _on_term)
    peers = env.ensure_peers(install=not a.no_install)
    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    if a.base is not None and not (a.base / "numaserve" / "__init__.py").is_file():
        print(f"bench: --base {a.base} is not a numaserve source tree (no numaserve/__init__.py)", file=sys.stderr)
        return 2
    ctx = Ctx(quick=a.quick, reps=a.reps or (1 if a.quick else 3), out=out, servers=servers, seed=a.seed,
              base=a.base.resolve() if a.base is not None else None)
    machine = env.machine_info()
    ctx.log(f"bench {'quick' if a.quick else 'full'}: {names} on {servers}, {ctx.reps} rep(s), "
            f"{machine['nproc']} CPUs, load {machine['loadavg_at_start']}")
    results: dict[str, Any] = {"meta": {"quick": a.quick, "reps": ctx.reps, "servers": list(servers),
                                        "machine": machine, "peers": peers,
                                        "command": "scripts/bench " + " ".join(argv if argv is not None
                                                                               else sys.argv[1:])},
                               "scenarios": {}}
    from benchlib import servers as srvmod

    failed = False
    try:
        for name in names:
            t = time.monotonic()
            try:
                results["scenarios"][name] = _runner(name)(ctx)
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as e:  # noqa: BLE001 - one broken scenario must not lose the others' numbers
                failed = True
                traceback.print_exc()
                results["scenarios"][name] = {"title": name, "error": f"{type(e).__name__}: {e}"}
            results["scenarios"][name]["elapsed_s"] = round(time.monotonic() - t, 1)
            ctx.log(f"{name} done in {time.monotonic() - t:.0f} s")
    finally:
        srvmod.stop_all()
    results["meta"]["elapsed_s"] = round(time.monotonic() - ctx.t0, 1)
    results["meta"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    from benchlib import report

    report.write_json(results, out / "results.json")
    report.write_markdown(results, out / "results.md")
    if "overload" in results["scenarios"] and "error" not in results["scenarios"]["overload"]:
        report.write_overload_md(results["scenarios"]["overload"], results["meta"], out / "overload.md")
    if not a.no_plots:
        from benchlib import plots

        made = plots.plot_all(results, out)
        results["meta"]["plots"] = made
        report.write_json(results, out / "results.json")
    ctx.log(f"wrote {out}/results.json, results.md and plots in {results['meta']['elapsed_s']:.0f} s")
    return 1 if failed else 0
