"""When to sample a worker's locality and when to repair it (pure: samples in, decisions out).

Repair acts only on a ratio that *stays* low: a single sample below the
threshold can be a moment (a burst of page cache on another node, a sample
taken mid-migration), and a repair costs something (``migrate`` copies every
remote page; ``recycle`` replaces the worker).  So a slot needs ``hold``
consecutive samples below ``threshold`` of its current worker; a sample at
or above the threshold, a new worker generation, or a repair carried out
starts the count again.  A repair the caller could not carry out yet (an
operation running) is asked for again on the next low sample.

Sampling is spaced so that all workers together stay within a CPU budget:
``interval_for`` stretches a worker's interval when its last sample cost
more than its share (``numa_maps`` costs grow with RSS).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["REPAIR_MODES", "RepairSettings", "LocalityJudge", "interval_for"]

REPAIR_MODES: tuple[str, ...] = ("off", "migrate", "recycle")


@dataclass(frozen=True)
class RepairSettings:
    """``[placement] repair``, ``repair_threshold``, ``repair_hold``."""

    mode: str = "off"
    threshold: float = 0.9
    hold: int = 3

    def __post_init__(self) -> None:
        if self.mode not in REPAIR_MODES:
            raise ValueError(f"repair mode {self.mode!r}: expected one of {', '.join(REPAIR_MODES)}")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"repair threshold {self.threshold!r}: expected a number in (0, 1]")
        if self.hold < 1:
            raise ValueError(f"repair hold {self.hold!r}: expected an integer >= 1")


@dataclass
class _Streak:
    generation: int
    low: int = 0


@dataclass
class LocalityJudge:
    """Per slot: how many samples in a row its current worker was below the threshold."""

    settings: RepairSettings
    _streaks: dict[int, _Streak] = field(default_factory=dict)

    def observe(self, slot: int, generation: int, local_ratio: float | None) -> str | None:
        """Feed one sample; the repair action due now ("migrate"/"recycle"), else None.

        ``local_ratio`` None (nothing resident, unreadable) neither counts nor
        breaks the streak.
        """
        st = self._streaks.get(slot)
        if st is None or st.generation != generation:
            st = self._streaks[slot] = _Streak(generation)
        if local_ratio is None:
            return None
        if local_ratio >= self.settings.threshold:
            st.low = 0
            return None
        st.low += 1
        if self.settings.mode == "off" or st.low < self.settings.hold:
            return None
        return self.settings.mode

    def low_samples(self, slot: int) -> int:
        """Consecutive low samples of the slot's current worker (shown in status)."""
        st = self._streaks.get(slot)
        return st.low if st else 0

    def repaired(self, slot: int) -> None:
        """A repair was carried out: the next one needs ``hold`` new low samples."""
        st = self._streaks.get(slot)
        if st is not None:
            st.low = 0

    def forget(self, keep: set[int]) -> None:
        for slot in [s for s in self._streaks if s not in keep]:
            del self._streaks[slot]


def interval_for(base_s: float, cost_s: float, workers: int, budget: float) -> float:
    """Seconds until a worker's next sample: ``base_s``, or longer when its last sample
    cost more than its share of ``budget`` (a fraction of one CPU shared by ``workers``)."""
    if budget <= 0:
        return base_s
    return max(base_s, cost_s * max(1, workers) / budget)
