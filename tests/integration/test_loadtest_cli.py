"""`numaserve loadtest` against the real demo app under `numaserve start`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any, Iterator

import pytest

from numaserve.tools.latency_view import slot_latencies
from tests.integration.harness import REPO, Running

pytestmark = pytest.mark.slow

TWO = ["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0"]

# Registers the diagnostics commands whether or not numaserve.cli.COMMANDS lists them yet.
_MAIN = ("import sys; from numaserve.cli import COMMANDS, main; "
         "COMMANDS.setdefault('loadtest', 'numaserve.cli.loadtest_cmd:loadtest'); "
         "COMMANDS.setdefault('profile', 'numaserve.cli.profile_cmd:profile'); main(sys.argv[1:])")


def ns(*args: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _MAIN, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=str(REPO))


@pytest.fixture(scope="module")
def sup() -> Iterator[Running]:
    with Running(TWO) as s:
        yield s


def test_closed_loop_summary_has_percentiles_and_no_errors(sup: Running) -> None:
    r = ns("loadtest", f"http://127.0.0.1:{sup.port}/v1/models", "-c", "4", "-d", "2s", "--no-json")
    assert r.returncode == 0, (r.stdout, r.stderr)
    out = r.stdout
    for needle in ("Running", "4 connections, closed loop", "Latency Distribution", "50%", "90%", "99%",
                   "99.9%", "Socket errors: none", "Requests/sec:", "Transfer/sec:"):
        assert needle in out, (needle, out)
    assert "Non-2xx" not in out and r.stderr == ""


def test_open_loop_json_completions(sup: Running) -> None:
    body = json.dumps({"prompt": "numa", "max_tokens": 8})
    r = ns("loadtest", f"http://127.0.0.1:{sup.port}/v1/completions", "-r", "50", "-d", "2s", "--arrivals",
           "uniform", "-m", "POST", "-H", "Content-Type: application/json", "-b", body, "--json")
    assert r.returncode == 0, (r.stdout, r.stderr)
    d = json.loads(r.stdout)
    assert d["mode"] == "open" and d["error_count"] == 0 and d["ok"] is True
    assert d["requests"] == 100 and d["status_counts"] == {"200": 100}
    lat = d["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]
    assert sum(c for _, c in d["histogram"]["buckets"]) == 100


def test_server_buckets_count_exactly_what_the_client_sent(sup: Running) -> None:
    """The slots' cumulative buckets grow by exactly the load test's request count."""
    before = settled_status(sup)          # earlier tests' requests fully reported first
    r = ns("loadtest", f"http://127.0.0.1:{sup.port}/healthz", "-c", "2", "-n", "300", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["requests"] == 300

    def settled(st: dict[str, Any]) -> bool:
        return sum(s.count for s in slot_latencies(st, before)) >= 300

    after = sup.wait_for(settled, timeout=15, what="worker stats to include the load")
    assert sum(s.count for s in slot_latencies(after, before)) == 300


def settled_status(sup: Running, quiet_s: float = 2.5, timeout: float = 20.0) -> dict[str, Any]:
    """A status whose bucket totals stayed unchanged for ``quiet_s`` (workers report every ~1 s)."""
    deadline = time.monotonic() + timeout
    last = sup.status()
    since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        cur = sup.status()
        counts = [s["totals"]["latency_count"] for s in cur["slots"]]
        if counts != [s["totals"]["latency_count"] for s in last["slots"]]:
            last, since = cur, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return cur
    raise AssertionError("worker stats never settled")


def test_refused_port_clear_summary_exit_1(sup: Running) -> None:
    from tests.integration.harness import free_port

    r = ns("loadtest", f"http://127.0.0.1:{free_port()}/", "-d", "3s", "--no-json", timeout=30)
    assert r.returncode == 1
    assert "connect 1" in r.stdout and "Connection refused" in r.stdout and "Traceback" not in r.stderr


def test_bad_arguments_exit_2_one_line(sup: Running) -> None:
    r = ns("loadtest", f"http://127.0.0.1:{sup.port}/", "--rate", "-3")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("numaserve: error:") and r.stderr.count("\n") == 1, r.stderr
