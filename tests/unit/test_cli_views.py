"""Terminal views: `status` and `top` fit 80 columns; `operation ID` shows the outcome."""

from __future__ import annotations

from typing import Any

import pytest

from numaserve.cli.fit import Column, fit_table, wrap_parts
from numaserve.cli.ops_cmd import TopView, show_operation, status_lines
from numaserve.errors import NumaserveError

REASON = ("lifespan startup failed: FileNotFoundError: [Errno 2] No such file or directory: "
          "'/models/llama-3-8b/model.safetensors'")


def slot(i: int, **kw: Any) -> dict[str, Any]:
    s: dict[str, Any] = {
        "slot": i, "node": i // 2, "pid": 1234567 + i, "generation": 12, "state": "ready",
        "cpus": list(range(12)) + [48, 49, 50, 51], "mempolicy": "bind", "memory_nodes": [i // 2],
        "binding_verified": True, "rss_bytes": 1234567890, "uptime_s": 3 * 86400, "restarts": 3,
        "requests": 123456789, "inflight": 12, "failed_reason": None, "last_restart_reason": None,
        "binding_problems": [],
    }
    s.update(kw)
    return s


def status(*slots: dict[str, Any]) -> dict[str, Any]:
    return {"supervisor": {"pid": 1, "state": "running", "uptime_s": 5000,
                           "listeners": ["0.0.0.0:8000", "[::]:8000"], "steering": {"mode": "numa"}},
            "slots": list(slots), "operations": []}


def test_status_fits_80_columns_and_wraps_by_slot() -> None:
    data = status(slot(0), slot(1, state="failed", failed_reason=REASON), slot(2, binding_verified=False))
    lines = status_lines(data, 80)
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    header = next(line for line in lines if line.startswith("slot"))
    for col in ("node", "pid", "state", "cpus", "rss", "reqs", "infl"):
        assert col in header.split()
    slot_lines = [line for line in lines if line[:4].strip().isdigit()]
    assert [int(line[:4]) for line in slot_lines] == [0, 1, 2]  # one main line per slot, in order
    assert all("…" not in line for line in lines)  # no cell cut
    text = " ".join(line.strip() for line in lines)
    assert REASON in text  # the whole failure reason, wrapped under its slot
    assert "binding MISMATCH" in text and "binding verified" not in text  # only the exception shows
    lines_at_1 = lines[lines.index(slot_lines[1]):lines.index(slot_lines[2])]
    assert any("FileNotFoundError" in line for line in lines_at_1)


def test_status_is_one_line_per_slot_when_wide() -> None:
    data = status(slot(0), slot(1))
    lines = status_lines(data, 200)
    assert len(lines) == 1 + 1 + 2 and "mempolicy" in lines[1] and "restarts" in lines[1]


def test_status_counts_refusals_per_reason_over_the_slots() -> None:
    data = status(slot(0, totals={"shed_by_reason": {"cpu": 40, "stalled": 7}}),
                  slot(1, totals={"shed_by_reason": {"cpu": 2, "quota": 0}}), slot(2))
    lines = status_lines(data, 80)
    assert lines[-1] == "refused (since start):  cpu 42  stalled 7", lines   # most first; zeros left out
    assert not any("refused" in line for line in status_lines(status(slot(0), slot(1)), 80))


def test_fit_table_keeps_priorities_and_natural_order() -> None:
    cols = [Column("a", "alpha", 2), Column("b", "beta", 0), Column("c", "gamma", 1, short="g")]
    rows = [{"a": "x" * 10, "b": "1", "c": "2"}]
    assert fit_table(cols, rows, 100) == ["alpha       beta  gamma", "xxxxxxxxxx  1     2"]
    narrow = fit_table(cols, rows, 12)
    assert narrow[:2] == ["beta  g", "1     2"] and all(len(line) <= 12 for line in narrow)
    assert "".join(narrow[2:]).replace(" ", "") == "alpha" + "x" * 10  # wrapped under its row
    assert fit_table(cols, rows, 12, details=False) == narrow[:2]
    assert wrap_parts(["aaaa", "bbbb", "cccc"], 10) == ["aaaa  bbbb", "cccc"]


def top_snapshot(ts: float, requests: int) -> dict[str, Any]:
    return {"ts": ts, "state": "running", "slots": [
        {"slot": i, "node": i // 2, "pid": 4000000 + i, "generation": 3, "state": "ready",
         "requests": requests * (i + 1), "latency_ms": {"p50": 12.3, "p99": 1234.5}, "inflight": 17,
         "queued": 3, "shed": 120, "rss_bytes": 2345678901, "limits": {"concurrency": 24}}
        for i in range(4)]}


def test_top_warms_up_until_a_rate_is_known_then_fits_80_columns() -> None:
    view = TopView()
    assert "warming up" in view.lines(80)[0]  # before the first snapshot
    view.update(top_snapshot(100.0, 10))
    first = view.lines(80)
    assert "warming up" in first[0] and view.warming_up
    assert all(r["rps"] is None for r in view.rows())  # not a fake 0 req/s
    view.update(top_snapshot(102.0, 1010))
    lines = view.lines(80)
    assert "warming up" not in lines[0] and not view.warming_up
    assert [r["rps"] for r in view.rows()] == [500.0, 1000.0, 1500.0, 2000.0]
    assert all(len(line) <= 80 for line in lines) and len(lines) == 2 + 4  # title, header, a line per slot
    assert "req/s" in lines[1] and "p99" in lines[1] and "2000.0" in lines[-1]


def op(state: str, result: str) -> dict[str, Any]:
    return {"operation": {"id": "op-7", "kind": "reload", "state": state, "elapsed_s": 4.2, "result": result,
                          "steps": [{"t": 0.01, "message": "slot 0: started generation 2"},
                                    {"t": 4.2, "message": state}]}}


def test_operation_without_wait_shows_the_outcome(capsys: pytest.CaptureFixture[str]) -> None:
    show_operation(op("succeeded", "2 slots replaced"), as_json=False)
    out = capsys.readouterr().out
    assert "op-7 (reload) succeeded" in out and "started generation 2" in out
    assert "reload op-7 succeeded: 2 slots replaced" in out
    with pytest.raises(NumaserveError, match="reload op-7 failed: slot 1 not ready"):
        show_operation(op("failed", "slot 1 not ready"), as_json=False)
    show_operation(op("running", ""), as_json=False)
    assert "--wait" in capsys.readouterr().out


def test_status_and_top_show_the_local_memory_share_and_threads_off_node() -> None:
    drifted = slot(1, locality={"local_ratio": 0.7234, "threads_off_node": 2})
    data = status(slot(0, locality={"local_ratio": 1.0, "threads_off_node": 0}), drifted, slot(2))
    lines = status_lines(data, 240)
    header = lines[1].split()
    assert "local" in " ".join(header) and "off node" in lines[1]
    rows = {int(line[:4]): line for line in lines[2:5]}
    assert "100%" in rows[0] and "72.3%" in rows[1] and rows[2].rstrip().endswith("-")
    assert rows[1].rstrip().endswith("2")
    assert all(len(line) <= 80 for line in status_lines(data, 80))
    view = TopView()
    view.update({"ts": 1.0, "state": "running", "slots": [dict(drifted, latency_ms={}, rss_bytes=1)]})
    row = view.rows()[0]
    assert row["local_ratio"] == 0.7234 and row["threads_off_node"] == 2
    assert "72.3%" in "\n".join(view.lines(200))


def test_a_loading_slot_shows_elapsed_time_and_the_apps_progress() -> None:
    from numaserve.cli.ops_cmd import _state

    assert _state({"state": "loading", "loading": {"elapsed_s": 42.3, "fraction": 0.35, "note": "layer 12/32"}}) \
        == "loading 42s 35% layer 12/32"
    assert _state({"state": "loading", "loading": {"elapsed_s": 600, "fraction": None, "note": None}}) \
        == "loading 10m"
    assert _state({"state": "ready", "loading": None}) == "ready"
