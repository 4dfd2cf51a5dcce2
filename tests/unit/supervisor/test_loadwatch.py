"""Load-state rules (issue 31): alive-and-loading vs stalled, on injected clocks and /proc readings."""

from __future__ import annotations

import os

import pytest

from numaserve.supervisor.loadwatch import (
    LoadProgress,
    ProcSample,
    load_verdict,
    parse_stat,
    read_sample,
    ready_timeout_message,
)


def sample(cpu: int = 0, io: int | None = 0, faults: int = 0, rss: int = 1 << 20, state: str = "S") -> ProcSample:
    return ProcSample(state=state, cpu_ticks=cpu, faults=faults, rss_bytes=rss, io_bytes=io)


def run(readings: list[ProcSample], *, step: float = 1.0, stall_after: float = 10.0) -> tuple[LoadProgress, list]:
    p = LoadProgress.begin(0.0)
    verdicts = []
    for i, s in enumerate(readings):
        now = (i + 1) * step
        p.observe(now, s)
        verdicts.append(load_verdict(p, now, stall_after=stall_after))
    return p, verdicts


@pytest.mark.parametrize("moving", ["cpu", "io", "faults", "rss"])
def test_any_counter_moving_keeps_a_silent_load_alive(moving: str) -> None:
    readings = [sample(**{{"rss": "rss"}.get(moving, moving): (i + 1) * (1 << 20)}) for i in range(60)]
    p, verdicts = run(readings)
    assert verdicts == [None] * 60 and p.last_sign == 60.0


def test_nothing_moving_for_longer_than_the_timeout_is_stalled() -> None:
    p, verdicts = run([sample(cpu=5)] * 12)
    assert verdicts[:10] == [None] * 10          # the first reading is the baseline: 0..10 s allowed
    assert verdicts[11] is not None and "stalled while loading" in verdicts[11]
    assert "for 12.0s" in verdicts[11] and "supervisor.heartbeat_timeout = 10" in verdicts[11]


def test_rss_shrinking_is_not_progress() -> None:
    readings = [sample(rss=(100 - i) << 20) for i in range(12)]
    _, verdicts = run(readings)
    assert verdicts[-1] is not None


def test_frozen_and_d_state_are_named() -> None:
    _, v = run([sample(state="T")] * 12)
    assert v[-1].startswith("frozen from outside (SIGSTOP)")
    _, v = run([sample(state="D")] * 12)
    assert "state D" in v[-1] and "no I/O moving" in v[-1]


def test_beats_and_reports_are_signs_of_life_when_counters_stand_still() -> None:
    p = LoadProgress.begin(0.0)
    for t in range(1, 100):
        p.observe(float(t), sample())
        if t % 5 == 0:
            p.heard(float(t), float(t) - 0.1, "load beat")
        assert load_verdict(p, float(t), stall_after=10.0) is None
    p.report(100.0, 99.5, 0.25, "layer 3/12")
    assert p.fraction == 0.25 and p.note == "layer 3/12" and p.sign == "progress report"
    assert p.describe(100.0) == "loading 100s 25% layer 3/12"
    p.heard(101.0, 95.0)                         # an older beat changes nothing
    assert p.last_sign == 99.5


def test_a_deadline_only_when_the_operator_sets_one() -> None:
    p = LoadProgress.begin(0.0)
    p.heard(600.0, 600.0)
    assert load_verdict(p, 600.0, stall_after=10.0, deadline=0.0) is None
    p = LoadProgress.begin(0.0)
    p.heard(61.0, 61.0)
    assert load_verdict(p, 61.0, stall_after=10.0, deadline=60.0) == (
        "supervisor.ready_timeout = 60 exceeded while loading (elapsed 61 s); raise it or set 0 for none")
    assert ready_timeout_message(60, 61.2).startswith("supervisor.ready_timeout = 60 exceeded")


def test_parse_stat_reads_state_cpu_faults_rss() -> None:
    line = "42 (py (odd) name) D 1 42 42 0 -1 4194560 100 0 7 0 300 50 0 0 20 0 3 0 12345 1000000 256 rest"
    assert parse_stat(line) == ("D", 350, 107, 256)
    with pytest.raises(ValueError):
        parse_stat("garbage")


def test_read_sample_of_this_process_and_of_a_gone_one() -> None:
    s = read_sample(os.getpid())
    assert s is not None and s.state in ("R", "S") and s.rss_bytes > 0 and s.cpu_ticks >= 0
    assert read_sample(2 ** 22 + 12345) is None


def test_a_tree_sample_adds_up_the_process_and_all_its_descendants(tmp_path) -> None:
    from numaserve.supervisor.loadwatch import read_tree_sample

    def proc(pid: int, ppid: int, state: str, cpu: int, rchar: int) -> None:
        d = tmp_path / str(pid)
        d.mkdir()
        # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ... rss(24)
        fields = [state, str(ppid)] + ["0"] * 5 + ["1", "0", "0", "0", str(cpu), "0"] + ["0"] * 8 + ["10"]
        (d / "stat").write_text(f"{pid} (x y) " + " ".join(fields) + "\n")
        (d / "io").write_text(f"rchar: {rchar}\nread_bytes: 0\n")

    proc(10, 1, "S", 5, 100)      # the command numaserve started, waiting
    proc(11, 10, "R", 50, 1000)   # its child, loading
    proc(12, 11, "D", 7, 10)      # a grandchild
    proc(13, 1, "R", 999, 5)      # not in the tree
    (tmp_path / "self").mkdir()
    s = read_tree_sample(10, str(tmp_path))
    assert s is not None and s.state == "S"
    assert s.cpu_ticks == 62 and s.io_bytes == 1110 and s.faults == 3
    assert read_tree_sample(99, str(tmp_path)) is None
