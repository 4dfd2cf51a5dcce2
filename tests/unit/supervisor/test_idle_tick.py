"""The settled supervisor's pace: ticks just after each point of the workers' beat grid, and the hold
of the worker channel only while every beat of the last grid point is in (``arbiter``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from numaserve.supervisor.arbiter import BEAT_SETTLE_S, Supervisor, after_grid, last_grid_point


def test_grid_points_and_the_wait_to_just_after_the_next_one() -> None:
    assert last_grid_point(10.05, 1.0, 0.03) == pytest.approx(10.0)
    assert last_grid_point(10.02, 1.0, 0.03) == pytest.approx(9.0)    # this point's beats are not due in yet
    assert after_grid(10.05, 1.0, 0.03) == pytest.approx(0.98)        # -> 11.03
    assert after_grid(10.02, 1.0, 0.03) == pytest.approx(0.01)        # -> 10.03
    assert after_grid(7.3, 0.25, 0.03) == pytest.approx(0.23)         # -> 7.53
    for now in (0.0, 0.031, 5.5, 1234.5678):
        for interval in (0.2, 1.0, 2.5):
            wait = after_grid(now, interval, BEAT_SETTLE_S)
            assert 0.0 < wait <= interval + 1e-9
            assert (now + wait - BEAT_SETTLE_S) / interval == pytest.approx(round((now + wait - BEAT_SETTLE_S)
                                                                                 / interval), abs=1e-6)


def _sup(beats: list[float | None], settled: bool = True, interval: float = 1.0) -> SimpleNamespace:
    slots = {i: SimpleNamespace(worker=SimpleNamespace(last_beat=b)) for i, b in enumerate(beats)}
    table = SimpleNamespace(slots=slots, cfg=SimpleNamespace(supervisor=SimpleNamespace(heartbeat_interval=interval)))
    return SimpleNamespace(_settled=lambda: settled, table=table)


def test_the_channel_is_held_only_while_settled_and_every_beat_of_the_last_grid_point_is_in() -> None:
    beats_in = Supervisor._beats_in
    assert beats_in(_sup([20.004, 20.031, 20.01]), 20.04)            # all of 20.0's beats read
    assert not beats_in(_sup([20.004, 19.6, 20.01]), 20.04)          # one late (off the grid): read as they come
    assert beats_in(_sup([20.004, 19.6, 20.01]), 20.02)              # 20.0's beats not due yet: 19.0's count
    assert not beats_in(_sup([20.004, None]), 20.04)
    assert not beats_in(_sup([20.004, 20.01], settled=False), 20.04)
