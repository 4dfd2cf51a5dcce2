"""numaserve.report_progress and the load beat: what a loading process tells the supervisor."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import numaserve
from numaserve import progress


@pytest.fixture
def progress_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "p.json"
    monkeypatch.setenv(progress.PROGRESS_ENV, str(path))
    progress._state["pid"] = None        # as after a fork: the path is looked up again
    yield path
    progress._state["pid"] = None


def test_outside_numaserve_it_is_a_no_op(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    progress._state["pid"] = None
    numaserve.report_progress(0.5, "x")
    with progress.LoadBeat(0.05):
        pass
    assert list(tmp_path.iterdir()) == []


def test_a_report_reaches_the_file_clamped_and_rate_limited(progress_file: Path) -> None:
    numaserve.report_progress(0.5, "layer 6/12")
    got = progress.read_progress(str(progress_file))
    assert got is not None and got["fraction"] == 0.5 and got["note"] == "layer 6/12"
    assert abs(got["at"] - time.monotonic()) < 60
    numaserve.report_progress(0.6, "layer 6/12")       # same note, within the interval: not written
    assert progress.read_progress(str(progress_file))["fraction"] == 0.5
    numaserve.report_progress(7.0, "done")              # a new note is written; 7 is clamped
    got = progress.read_progress(str(progress_file))
    assert got["fraction"] == 1.0 and got["note"] == "done"
    numaserve.report_progress(float("nan"), "z")
    assert progress.read_progress(str(progress_file))["fraction"] is None


def test_the_load_beat_stamps_and_its_thread_is_gone_after_stop(progress_file: Path) -> None:
    import threading

    with progress.LoadBeat(0.05):
        time.sleep(0.3)
        first = progress.read_progress(str(progress_file))["beat"]
        time.sleep(0.3)
        assert progress.read_progress(str(progress_file))["beat"] > first
        (beat,) = [t for t in threading.enumerate() if t.name == "numaserve-load-beat"]
        tid = beat.native_id
        assert os.path.exists(f"/proc/self/task/{tid}")
    assert not any(t.name == "numaserve-load-beat" for t in threading.enumerate())
    assert not os.path.exists(f"/proc/self/task/{tid}")  # gone from the kernel too: a template forks next


def test_stop_waits_for_the_kernel_task_not_only_the_join(tmp_path: Path) -> None:
    """join() returns a moment before the kernel task exits; on a busy CPU a template's
    thread check saw the exiting beat thread and refused every fork (CI, stop 39)."""
    import threading

    task = tmp_path / "self" / "task" / "4242"
    task.mkdir(parents=True)
    threading.Timer(0.2, task.rmdir).start()
    t0 = time.monotonic()
    assert progress.wait_task_gone(4242, timeout=5, proc=str(tmp_path))
    assert time.monotonic() - t0 >= 0.15
    task.mkdir()
    assert not progress.wait_task_gone(4242, timeout=0.05, proc=str(tmp_path))


def test_read_progress_of_garbage_is_none(tmp_path: Path) -> None:
    (tmp_path / "bad").write_text("{not json")
    assert progress.read_progress(str(tmp_path / "bad")) is None
    assert progress.read_progress(str(tmp_path / "missing")) is None
    (tmp_path / "odd").write_text('{"fraction": "x", "note": 5, "beat": true}')
    assert progress.read_progress(str(tmp_path / "odd")) == {"beat": None, "at": None, "fraction": None, "note": ""}
    assert os.path.exists(tmp_path / "odd")
