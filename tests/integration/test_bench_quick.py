"""`scripts/bench --quick` keeps working: every scenario produces numbers for
numaserve, uvicorn and gunicorn, plus the markdown tables and the plots.

Checks shapes only, never timings (the machine is shared and noisy): quick
mode takes about 3 minutes on 2 quiet CPUs and longer beside other work, so
the only bound is a hard stop (``HARD_STOP_S``) that keeps a wedged bench from
eating the suite's budget; the duration is printed, not asserted.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "scripts" / "bench"
SERVERS = ("numaserve", "uvicorn", "gunicorn")
SCENARIOS = ("throughput", "overload", "admission", "resilience", "balance", "overhead", "startup")
HARD_STOP_S = 900.0

pytestmark = pytest.mark.slow


def _peers_available() -> str | None:
    """None when gunicorn and matplotlib import, else why not (``scripts/install`` installs them;
    a test never installs packages itself)."""
    missing = []
    for mod in ("gunicorn", "matplotlib"):
        try:
            importlib.import_module(mod)
        except ImportError:
            missing.append(mod)
    return f"{', '.join(missing)} not installed (scripts/install installs the bench peers)" if missing else None


#: Set in the bench's environment (its servers inherit it): strays are told from
#: servers other work on this machine started (another checkout's bench, say).
RUN_MARK = "NUMASERVE_BENCH_QUICK_RUN"


def _bench_processes(since: float, mark: str) -> list[str]:
    """Servers this bench run started (they inherit ``RUN_MARK``) that are still alive."""
    out = []
    for p in psutil.process_iter(["cmdline", "create_time"]):
        try:
            if p.info["create_time"] < since - 1 or p.pid == os.getpid():
                continue
            if p.environ().get(RUN_MARK) != mark or p.status() == psutil.STATUS_ZOMBIE:
                continue
            out.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}")
        except psutil.Error:
            continue
    return out


def _servers_in(rows: list[dict[str, Any]]) -> set[str]:
    return {r["server"].split("-")[0].split(" ")[0] for r in rows}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    why = _peers_available()
    if why:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("bench")
    t0 = time.time()
    log = open(out / "bench.log", "wb")
    mark = f"{os.getpid()}-{t0}"
    proc = subprocess.Popen([sys.executable, str(BENCH), "--quick", "--no-install", "--out", str(out)],
                            cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, RUN_MARK: mark})
    try:
        proc.wait(HARD_STOP_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)   # the bench stops its servers on SIGTERM
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        pytest.fail(f"scripts/bench --quick did not finish in {HARD_STOP_S:.0f} s\n"
                    + (out / "bench.log").read_text(errors="replace")[-3000:])
    finally:
        log.close()
    elapsed = time.time() - t0
    print(f"scripts/bench --quick took {elapsed:.0f} s")
    assert proc.returncode == 0, (out / "bench.log").read_text(errors="replace")[-4000:]
    deadline = time.time() + 20
    while _bench_processes(t0, mark) and time.time() < deadline:
        time.sleep(0.5)
    assert not _bench_processes(t0, mark), f"stray server processes: {_bench_processes(t0, mark)}"
    return out, elapsed


def test_every_scenario_has_numbers_for_every_server(quick_run: tuple[Path, float]) -> None:
    out, _ = quick_run
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["quick"] is True
    sc = res["scenarios"]
    for name in SCENARIOS:
        assert name in sc, f"scenario {name} missing"
        assert "error" not in sc[name], f"{name}: {sc[name].get('error')}"

    for variant in {(r["variant"], r["placement"]) for r in sc["throughput"]["rows"]}:
        rows = [r for r in sc["throughput"]["rows"] if (r["variant"], r["placement"]) == variant]
        assert _servers_in(rows) == set(SERVERS), variant
        assert all(r["rps"]["median"] and r["rps"]["median"] > 0 for r in rows), variant
    assert {r["variant"] for r in sc["throughput"]["rows"]} == {"tiny", "cpu5"}

    ov = sc["overload"]
    assert ov["capacity"]["common_rps"] > 0
    assert _servers_in(ov["rows"]) == set(SERVERS)
    for r in ov["rows"]:
        assert r["slo_goodput_rps"]["median"] is not None and r["cpu_after_s"]["median"] is not None
        assert r["reps"][0]["sent"] > 0
    assert ov["targets"], "issue-10 targets not evaluated"

    for event in ("reload", "kill"):
        rows = [r for r in sc["resilience"]["rows"] if r["event"] == event]
        assert _servers_in(rows) == set(SERVERS), event
        assert all(r["failed"]["median"] is not None and r["baseline_rps"]["median"] > 0 for r in rows)

    assert _servers_in(sc["balance"]["rows"]) == set(SERVERS)
    assert all(0.5 <= r["busiest_share"]["median"] <= 1.0 for r in sc["balance"]["rows"])
    assert _servers_in(sc["balance"]["locality"]) == set(SERVERS)
    assert all(r["local_share"]["median"] is not None for r in sc["balance"]["locality"])

    adm = sc["admission"]
    assert _servers_in(adm["rows"]) == set(SERVERS)
    assert all(r["sent"] > 0 and r["served"] + r["refused_503"] + sum(r["other"].values()) == r["sent"]
               for r in adm["rows"])

    rows = {r["server"]: r for r in sc["overhead"]["rows"]}
    assert set(rows) == set(SERVERS)
    assert all(r["supervisor_idle_cpu_pct_summary"]["median"] is not None for r in rows.values())
    assert rows["numaserve"]["control_latency_s"] and all(x is not None for x in rows["numaserve"]["control_latency_s"])

    rows = sc["startup"]["rows"]
    assert _servers_in(rows) == set(SERVERS)
    assert all(r["all_ready_s"]["median"] > 0 for r in rows)


def test_markdown_and_plots(quick_run: tuple[Path, float]) -> None:
    out, _ = quick_run
    md = (out / "results.md").read_text()
    for title in ("Throughput", "Overload", "Reload", "balance", "overhead", "Start-up"):
        assert title in md, title
    for srv in SERVERS:
        assert srv in md
    assert "Issue-13 targets" in (out / "overload.md").read_text()  # issue 13 tightened the issue-10 targets
    res = json.loads((out / "results.json").read_text())
    pngs = sorted(out.glob("*.png"))
    assert {p.name for p in pngs} == set(res["meta"]["plots"])
    assert len(pngs) >= 5
    for p in pngs:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, p.name
