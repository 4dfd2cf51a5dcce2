"""The overload-sweep verdicts (scripts/benchlib/scen_overload_sweep.py) judge issue 32's
done-when criteria from made-up medians: pure logic, no server, no timing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import pytest  # noqa: E402

from benchlib.scen_overload_sweep import BASE_LABEL, SweepParams, _config, _fixed_capacity, _narrowed, verdicts  # noqa: E402


def _row(server: str, level: float, **medians: float | None) -> dict[str, Any]:
    base = {"goodput_rps": 90.0, "ok_500ms_rps": 90.0, "p99_admitted_ms": 30.0, "shed_new_p99_ms": None,
            "shed_frac": 0.0, "timeout_frac": 0.0}
    base.update(medians)
    return {"shape": "blocking", "level": level, "server": server,
            **{k: {"median": v, "min": v, "max": v, "n": 1} for k, v in base.items()}}


def _by_criterion(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {v["criterion"]: v for v in verdicts(rows)}


def test_all_met_and_the_503_criterion_without_503s_is_unknown() -> None:
    rows = [_row(s, lv) for s in ("numaserve", "uvicorn", "gunicorn") for lv in (0.5, 1.0, 2.0)]
    v = _by_criterion(rows)
    assert all(x["met"] is True for k, x in v.items() if "503" not in k), v
    assert v["1-3 C: 503 on new connections p99 <= 50 ms"]["met"] is None


def test_each_criterion_fails_on_its_own_number() -> None:
    rows = [_row("uvicorn", lv) for lv in (0.5, 1.0, 2.0)] + [_row("gunicorn", lv, p99_admitted_ms=20.0)
                                                             for lv in (0.5, 1.0, 2.0)]
    rows += [_row("numaserve", 0.5, shed_frac=0.006, p99_admitted_ms=41.0),
             _row("numaserve", 1.0, goodput_rps=100.0),
             _row("numaserve", 2.0, goodput_rps=89.0, ok_500ms_rps=89.5, timeout_frac=0.001,
                  p99_admitted_ms=251.0, shed_new_p99_ms=51.0)]
    v = _by_criterion(rows)
    assert {k for k, x in v.items() if x["met"] is False} == set(v), v
    assert v["1-3 C: ok/s >= 0.9 x own peak"]["detail"].startswith("2x:")   # 89 < 0.9 x 100; 1x is the peak
    assert "best peer 20.0 ms" in v["below 0.9 C: p99 <= 2x the best peer's"]["detail"]


def test_the_environment_narrows_the_sweep_to_a_few_points() -> None:
    p = SweepParams()
    assert _narrowed(p, {}) == p
    n = _narrowed(p, {"NUMASERVE_SWEEP_LEVELS": "0.9, 1", "NUMASERVE_SWEEP_SHAPES": "cooperative"})
    assert n.levels == (0.9, 1.0) and n.shapes == ("cooperative",) and n.duration_s == p.duration_s
    with pytest.raises(ValueError, match="NUMASERVE_SWEEP_SHAPES.*'blocked'"):
        _narrowed(p, {"NUMASERVE_SWEEP_SHAPES": "blocked"})


def test_the_environment_adds_a_setting_to_this_checkouts_numaserve_only() -> None:
    """``NUMASERVE_SWEEP_TOML``: an A/B of a setting against the same code run as ``--base``."""
    p = SweepParams()
    env = {"NUMASERVE_SWEEP_TOML": "[admission]\\ncpu_concurrency = 3"}
    assert _config("numaserve", p, "/base", env).numaserve_toml.endswith("[admission]\ncpu_concurrency = 3")
    assert "cpu_concurrency" not in _config(BASE_LABEL, p, "/base", env).numaserve_toml
    assert _config("numaserve", p, "/base", {}).numaserve_toml.strip() == ""


def test_the_environment_can_fix_the_capacity() -> None:
    assert _fixed_capacity({}) is None
    assert _fixed_capacity({"NUMASERVE_SWEEP_CAPACITY": " 91.2 "}) == 91.2
    for bad in ("fast", "0", "-3", "nan"):
        with pytest.raises(ValueError, match="NUMASERVE_SWEEP_CAPACITY"):
            _fixed_capacity({"NUMASERVE_SWEEP_CAPACITY": bad})
