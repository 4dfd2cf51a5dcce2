"""The locality repair decision and the sampling interval, on injected samples."""

from __future__ import annotations

import pytest

from numaserve.loops.locality import LocalityJudge, RepairSettings, interval_for


def feed(j: LocalityJudge, ratios: list[float | None], slot: int = 0, generation: int = 1) -> list[str | None]:
    return [j.observe(slot, generation, r) for r in ratios]


def test_repair_needs_hold_consecutive_low_samples() -> None:
    j = LocalityJudge(RepairSettings("migrate", 0.9, 3))
    assert feed(j, [0.5, 0.5]) == [None, None]
    assert j.low_samples(0) == 2
    assert feed(j, [0.5]) == ["migrate"]


def test_a_good_sample_breaks_the_streak_and_none_does_not() -> None:
    j = LocalityJudge(RepairSettings("recycle", 0.9, 2))
    assert feed(j, [0.5, 0.95, 0.5]) == [None, None, None]
    assert feed(j, [None, 0.5]) == [None, "recycle"]   # unreadable sample: neither counts nor breaks


def test_threshold_itself_is_not_low() -> None:
    j = LocalityJudge(RepairSettings("migrate", 0.9, 1))
    assert feed(j, [0.9, 0.8999]) == [None, "migrate"]


def test_off_counts_but_never_repairs() -> None:
    j = LocalityJudge(RepairSettings("off", 0.9, 1))
    assert feed(j, [0.1, 0.1, 0.1]) == [None, None, None]
    assert j.low_samples(0) == 3


def test_a_carried_out_repair_waits_hold_new_samples_a_deferred_one_asks_again() -> None:
    j = LocalityJudge(RepairSettings("migrate", 0.9, 2))
    assert feed(j, [0.2, 0.2]) == [None, "migrate"]
    assert feed(j, [0.2]) == ["migrate"]                 # not carried out (deferred): asked again
    j.repaired(0)
    assert feed(j, [0.2, 0.2]) == [None, "migrate"]


def test_a_new_generation_starts_afresh_and_slots_are_separate() -> None:
    j = LocalityJudge(RepairSettings("recycle", 0.9, 2))
    assert feed(j, [0.2], generation=1) == [None]
    assert feed(j, [0.2], generation=2) == [None]        # the new worker's first low sample
    assert feed(j, [0.2], slot=1) == [None]
    assert feed(j, [0.2], generation=2) == ["recycle"]
    j.forget({1})
    assert j.low_samples(0) == 0 and j.low_samples(1) == 1


@pytest.mark.parametrize("kw, why", [
    ({"mode": "move"}, "repair mode 'move'"),
    ({"threshold": 0.0}, r"threshold 0.0: expected a number in \(0, 1\]"),
    ({"threshold": 1.5}, "threshold 1.5"),
    ({"hold": 0}, "hold 0"),
])
def test_bad_settings_are_named(kw: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        RepairSettings(**kw)


def test_interval_stretches_to_keep_the_cpu_budget() -> None:
    assert interval_for(10.0, 0.001, 32, 0.01) == 10.0        # 32 ms per round over 10 s: 0.32 %
    # a 20 ms sample of each of 32 workers: 0.64 s of CPU per round -> one round per 64 s for 1 %
    assert interval_for(10.0, 0.02, 32, 0.01) == pytest.approx(64.0)
    assert interval_for(10.0, 5.0, 0, 0.0) == 10.0             # no budget given: the base interval
