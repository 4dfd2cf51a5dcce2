"""scripts/bench_hotpath.py keeps working: every kind (keep-alive, SSE, a new connection per
request) runs through uvicorn's stack and the worker numaserve assembles (shapes, never timings)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_hotpath  # noqa: E402


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", bench_hotpath.KINDS)
def test_every_kind_runs_on_uvicorn_and_on_the_numaserve_worker(kind: str) -> None:
    stacks = bench_hotpath.stacks(5)
    for name in ("uvicorn (proxy headers on, its default)", "numaserve worker (edge assembly, defaults)"):
        cpu = bench_hotpath.run_kind(stacks[name], kind, 20)
        assert cpu > 0, (name, kind)


def test_an_unknown_kind_is_a_clear_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bench_hotpath.main(["--kinds", "tiny,bogus"])
    assert e.value.code == 2
    assert "--kinds: unknown bogus" in capsys.readouterr().err
