"""Long loads with the real supervisor (issue 31): loading is not hung, kills from outside while
loading are retried, a stalled load is found, a raising lifespan is a startup failure.

The loads are a few seconds against a heartbeat_timeout of 3 s and no ready_timeout (the new
default); nothing here asserts a duration.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from tests.integration.harness import APPS, EXEC_WORKERS, FAST_CONFIG, Running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

#: FAST_CONFIG without a loading deadline (the default since issue 31).
LOAD_CONFIG = FAST_CONFIG.replace("ready_timeout = 30.0\n", "ready_timeout = 0\n")
assert LOAD_CONFIG != FAST_CONFIG


def _args(*extra: str) -> list[str]:
    return ["--app", "loadapp:app", "--app-dir", str(APPS), "--preload", "loadapp:load", "--nodes", "0",
            "--workers-per-node", "1", "--bind", "127.0.0.1:0", *extra]


def _killed_or_hung(sup: Running) -> list[dict[str, Any]]:
    return [e for e in sup.events() if e.get("event") in ("hang", "template_killed", "worker_crash", "template_exit")]


def test_a_preload_longer_than_heartbeat_timeout_reporting_progress_serves_loading_meanwhile() -> None:
    with Running(_args(), config=LOAD_CONFIG, env={"LOADAPP_MODE": "report", "LOADAPP_S": "8"},
                 expect_ready=False) as sup:
        st = sup.wait_for(lambda st: st["slots"] and st["slots"][0]["state"] == "loading"
                          and (st["slots"][0]["loading"] or {}).get("fraction") is not None, 60, "loading with progress")
        load = st["slots"][0]["loading"]
        assert load["by"] == "template" and load["note"].startswith("shard ") and load["elapsed_s"] >= 0
        assert st["templates"]["nodes"][0]["loading"]["fraction"] is not None
        sup.wait_ready(120)
        assert _killed_or_hung(sup) == []


def test_a_preload_holding_the_gil_in_an_exec_worker_is_not_killed() -> None:
    # no thread of the worker runs while int() converts: only its CPU time shows it is alive
    with Running(_args(), config=LOAD_CONFIG + EXEC_WORKERS,
                 env={"LOADAPP_MODE": "gil", "LOADAPP_S": "8", "LOADAPP_CALL_S": "4"}, expect_ready=False) as sup:
        sup.wait_for(lambda st: st["slots"] and st["slots"][0]["state"] == "loading", 60, "loading")
        sup.wait_ready(180)
        assert _killed_or_hung(sup) == []


def test_a_plain_sleeping_preload_in_an_exec_worker_is_not_killed() -> None:
    with Running(_args(), config=LOAD_CONFIG + EXEC_WORKERS, env={"LOADAPP_MODE": "sleep", "LOADAPP_S": "7"},
                 expect_ready=False) as sup:
        sup.wait_ready(120)
        assert _killed_or_hung(sup) == []


def test_a_sigstopped_loading_worker_is_detected_killed_and_replaced() -> None:
    with Running(_args(), config=LOAD_CONFIG + EXEC_WORKERS, env={"LOADAPP_MODE": "sleep", "LOADAPP_S": "4"},
                 expect_ready=False) as sup:
        st = sup.wait_for(lambda st: st["slots"] and st["slots"][0]["state"] == "loading" and st["slots"][0]["pid"],
                          60, "loading")
        pid = st["slots"][0]["pid"]
        os.kill(pid, signal.SIGSTOP)
        sup.wait_for(lambda st: any(e.get("event") == "hang" and e.get("pid") == pid for e in sup.events()),
                     60, "the frozen load found")
        hang = next(e for e in sup.events() if e.get("event") == "hang" and e.get("pid") == pid)
        assert hang["reason"].startswith("frozen from outside (SIGSTOP): stalled while loading"), hang
        st = sup.wait_ready(120)
        assert st["slots"][0]["pid"] != pid and st["slots"][0]["last_exit_kind"] == "external"


def test_kill_9_of_each_loading_worker_six_times_serves_again_without_exit_3() -> None:
    with Running(_args(), config=LOAD_CONFIG + EXEC_WORKERS, env={"LOADAPP_MODE": "sleep", "LOADAPP_S": "3"},
                 expect_ready=False) as sup:
        killed: list[int] = []
        states: set[str] = set()
        for _ in range(6):      # from the first start on: nothing has ever served
            st = sup.wait_for(lambda st: st["slots"] and st["slots"][0]["state"] == "loading"
                              and st["slots"][0]["pid"] not in (None, *killed), 60, "a new loading worker")
            states.add(st["supervisor"]["state"])
            pid = st["slots"][0]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        st = sup.wait_for(lambda st: st["supervisor"]["state"] == "failed", 30, "every slot down: failed")
        st = sup.wait_ready(120)
        assert sup.proc.poll() is None and st["supervisor"]["state"] == "running"
        crashes = [e for e in sup.events() if e.get("event") == "worker_crash" and e.get("pid") in killed]
        assert len(crashes) == 6 and all(e["kind"] == "external" and "while loading" in e["why"] for e in crashes)
        assert any(e.get("event") == "service_failed" for e in sup.events())
        assert not any(e.get("event") == "slot_failed" for e in sup.events())
        assert "failed" in states


def test_a_lifespan_raising_after_startup_exits_3_with_its_text() -> None:
    sup = Running(_args(), config=LOAD_CONFIG,
                  env={"LOADAPP_S": "0", "LOADAPP_LIFESPAN_RAISE": "no weights under /models"}, expect_ready=False)
    try:
        assert sup.wait_exit(120) == 3
        lines = sup.stderr_path.read_text().splitlines()
        error = [line for line in lines if line.startswith("numaserve: error:")]
        assert error == ["numaserve: error: no slot could start: lifespan startup failed: "
                         "RuntimeError: no weights under /models"], lines[-5:]
    finally:
        sup.close()
