"""Steering leaves out a slot whose worker is at its open-file limit, unless every slot is."""

from __future__ import annotations

from numaserve.supervisor.routing import without_fd_limited


def test_fd_limited_slots_are_left_out_until_they_recover() -> None:
    assert without_fd_limited([0, 1, 2], [0]) == [1, 2]
    assert without_fd_limited([0, 1, 2], []) == [0, 1, 2]
    assert without_fd_limited([1, 2], [0, 3]) == [1, 2]       # not healthy anyway: nothing to remove


def test_when_every_slot_is_limited_all_keep_their_share() -> None:
    assert without_fd_limited([0, 1], [0, 1]) == [0, 1]
    assert without_fd_limited([], [0]) == []
