"""L1: the worker's concurrency limit, an Envoy-style gradient on *service* time.

Pure: the admission gate feeds one sample per finished request and calls
``update(now)``; the controller never reads a clock.  Queue time is excluded
on purpose (the gate's CoDel handles it); mixing it in is what made the
anchors' baselines drift (Gradient2, Envoy #11579; FACTS-limits-leaks §9.1).

Per window (≥ 0.5 s and ≥ 30 samples, at most 5 s):
``g = clamp(baseline·(1+buffer)/sample, 0.5, 2)``, ``L = L·g + sqrt(L·g)``
(the sqrt headroom only when g ≥ 1, Netflix PR #134: otherwise a gradient
near 0.8 keeps creeping up); decreases smoothed (weight 0.5, full while CoDel
reports overload); no increase while app-limited (window max in-flight < L/2);
growth capped at 5 × window max in-flight; a 504 in the window → ``L·0.9``.
Baseline: a quantile of ≥ 50 probe samples taken at ``max(floor, ceil(L/4))``
from requests started after the probe began, every 60 s (+ jitter) and at
once after 5 windows at the floor; the last 3 probes are kept and the minimum
used (a forced probe replaces them: a floor-pinned limit means a stale baseline).

Sample and baseline use the **same** quantile (p50 by default, Envoy's
default).  FACTS §9.3 proposed p90 against a p50 baseline; with cv 0.5
service times p90/p50 ≈ 1.8 > 1.25, so g < 1 even without any queue and the
limit settles near ``g/(1−g)² ≈ 7`` whatever the capacity: in the test
simulator goodput at 3 C fell to 0.49 with 16 servers and 0.14 with 64
(and 0.14 even at 0.8 C), while like-for-like holds 1.00 at 2–64 servers.
"""

from __future__ import annotations

import math
import random
from collections import deque
from typing import Literal

import msgspec

from numaserve.loops.checks import at_least, fraction, ordered, positive
from numaserve.loops.trend import quantile

__all__ = ["GradientController", "GradientSettings", "GradientState", "L1Outcome"]

L1Outcome = Literal["ok", "dropped", "ignored"]


class GradientSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The worker-side L1 controller (FACTS-limits-leaks §9.3)."""

    initial_limit: float = 16.0
    min_limit: float = 2.0               # floor
    max_limit: float = 256.0             # ceiling
    window_s: float = 0.5
    window_min_samples: int = 30
    window_max_s: float = 5.0            # a window ends here even if short of samples
    window_floor_samples: int = 10       # ... and then needs this many to update (else hold)
    percentile: float = 0.5              # of successful service times in the window (Envoy default)
    buffer: float = 0.25                 # tolerated service growth over the baseline
    buffer_min_s: float = 0.002          # timer noise floor of the buffer
    gradient_min: float = 0.5
    gradient_max: float = 2.0
    decrease_smoothing: float = 0.5      # weight of a decrease (1.0 while CoDel-overloaded)
    headroom_min_gradient: float = 1.0   # add the sqrt(L) headroom only when g ≥ this (0: always)
    drop_backoff: float = 0.9            # L ← 0.9·L on a 504 in the window (once per window)
    app_limited_ratio: float = 0.5       # no increase if window max in-flight < ratio × L
    growth_cap_factor: float = 5.0       # L ≤ factor × window max in-flight when increasing
    probe_interval_s: float = 60.0       # 0: probe only when asked or forced
    probe_jitter: float = 0.15           # + U(0, jitter) × interval
    probe_samples: int = 50
    probe_percentile: float = 0.0  # baseline quantile of the probe; 0 = same as ``percentile``
    probe_fraction: float = 0.25         # probe limit = max(floor, ceil(fraction × L))
    probe_max_s: float = 10.0            # give up a probe after this long ...
    probe_min_samples: int = 10          # ... using what it has if at least this many
    floor_windows_before_probe: int = 5
    baselines_kept: int = 3

    def __post_init__(self) -> None:
        at_least(self, 1, "min_limit", "window_min_samples", "probe_samples", "baselines_kept")
        at_least(self, 0, "buffer", "buffer_min_s", "headroom_min_gradient", "app_limited_ratio", "growth_cap_factor",
                 "probe_interval_s", "probe_jitter", "probe_min_samples", "window_floor_samples",
                 "floor_windows_before_probe")
        positive(self, "initial_limit", "max_limit", "window_s", "window_max_s", "probe_max_s", "gradient_max")
        ordered(self, "min_limit", "initial_limit")
        ordered(self, "initial_limit", "max_limit")
        ordered(self, "window_s", "window_max_s")
        fraction(self, "percentile", low_open=True, high_open=True)
        fraction(self, "probe_percentile", high_open=True)
        fraction(self, "gradient_min", "probe_fraction", "decrease_smoothing", "drop_backoff", low_open=True)
        at_least(self, 1, "gradient_max")


class GradientState(msgspec.Struct, kw_only=True):
    """Snapshot for Stats and tests."""

    limit: float
    nominal_limit: float
    baseline_s: float | None
    baseline_p50_s: float | None
    probing: bool
    probes: int
    windows: int
    last_gradient: float | None
    last_sample_s: float | None
    last_reason: str
    next_probe_at: float | None
    floor_windows: int


class GradientController:
    """Concurrency limit from service-time samples; see the module docstring."""

    def __init__(self, settings: GradientSettings, now: float, rng: random.Random | None = None) -> None:
        self.s = settings
        self._rng = rng or random.Random()
        self._limit = float(settings.initial_limit)
        self._baselines: deque[tuple[float, float]] = deque(maxlen=max(1, settings.baselines_kept))
        self.baseline_s: float | None = None      # compared with the window sample
        self.baseline_p50_s: float | None = None  # the probe's p50 (the gate's CoDel target)
        self.probes = 0
        self.windows = 0
        self.last_gradient: float | None = None
        self.last_sample_s: float | None = None
        self.last_reason = "start"
        self._floor_windows = 0
        self._next_probe: float | None = None
        # probe state
        self._probing = False
        self._probe_start = now
        self._probe_limit = 0.0
        self._probe_samples: list[float] = []
        # window state
        self._win_start = now
        self._win_ok: list[float] = []
        self._win_max_inflight = 0
        self._win_drop = False
        self.start_probe(now)  # no baseline yet: measure one first (as Envoy)

    # --- outputs -------------------------------------------------------------------------

    @property
    def limit(self) -> float:
        """The in-flight limit to enforce now (pinned low while probing)."""
        return min(self._probe_limit, self._limit) if self._probing else self._limit

    @property
    def nominal_limit(self) -> float:
        """The limit outside probes (what the probe returns to)."""
        return self._limit

    @property
    def probing(self) -> bool:
        return self._probing

    def state(self) -> GradientState:
        return GradientState(
            limit=self.limit, nominal_limit=self._limit, baseline_s=self.baseline_s,
            baseline_p50_s=self.baseline_p50_s,
            probing=self._probing, probes=self.probes, windows=self.windows,
            last_gradient=self.last_gradient, last_sample_s=self.last_sample_s,
            last_reason=self.last_reason, next_probe_at=self._next_probe, floor_windows=self._floor_windows,
        )

    # --- inputs ----------------------------------------------------------------------------

    def on_sample(self, now: float, service_s: float, inflight_at_start: int, outcome: L1Outcome,
                  started_at: float | None = None) -> None:
        """One finished request: service time (permit → finish), in-flight count when it started.

        ``outcome``: "ok"; "dropped" (504: deadline hit in the handler, counts
        as a congestion signal); "ignored" (500: failed before a meaningful
        time was measured; Netflix ``onIgnore``).
        """
        if outcome == "ignored":
            return
        if inflight_at_start > self._win_max_inflight:
            self._win_max_inflight = inflight_at_start
        if self._probing:
            start = now - service_s if started_at is None else started_at
            if outcome == "ok" and start >= self._probe_start:  # epoch filter (Envoy #11579)
                self._probe_samples.append(service_s)
            return
        if outcome == "dropped":
            self._win_drop = True
        elif outcome == "ok":
            self._win_ok.append(service_s)

    def start_probe(self, now: float, *, forced: bool = False) -> None:
        """Pin the limit at ``max(floor, ceil(L/4))`` and measure a fresh baseline.

        ``forced`` (stuck at the floor) drops the kept baselines: the old ones
        are what pinned the limit there.
        """
        if forced:
            self._baselines.clear()
        self._probing = True
        self._probe_start = now
        self._probe_samples = []
        self._probe_limit = max(self.s.min_limit, float(math.ceil(self.s.probe_fraction * self._limit)))
        self.last_reason = "probe (forced)" if forced else "probe"

    def update(self, now: float, overloaded: bool = False) -> float:
        """Advance the controller; returns the limit to enforce.  Call often; it acts per window."""
        s = self.s
        if self._probing:
            self._maybe_finish_probe(now)
            return self.limit
        if self._next_probe is not None and now >= self._next_probe:
            self.start_probe(now)
            return self.limit
        elapsed = now - self._win_start
        n = len(self._win_ok)
        if not ((elapsed >= s.window_s and (n >= s.window_min_samples or self._win_drop))
                or elapsed >= s.window_max_s):
            return self._limit
        self._close_window(now, overloaded)
        return self.limit

    # --- internals -------------------------------------------------------------------------

    def _reset_window(self, now: float) -> None:
        self._win_start = now
        self._win_ok = []
        self._win_max_inflight = 0
        self._win_drop = False

    def _maybe_finish_probe(self, now: float) -> None:
        s = self.s
        n = len(self._probe_samples)
        timed_out = now - self._probe_start >= s.probe_max_s
        if n < s.probe_samples and not timed_out:
            return
        if n >= s.probe_samples or n >= s.probe_min_samples:
            ordered = sorted(self._probe_samples)
            measured = quantile(ordered, s.probe_percentile or s.percentile)
            self._baselines.append((measured, quantile(ordered, 0.5)))
            self.baseline_s = min(b for b, _ in self._baselines)
            self.baseline_p50_s = min(p for _, p in self._baselines)
            self.last_reason = f"baseline {measured * 1e3:.1f} ms from {n} samples"
        elif self.baseline_s is None:
            return  # nothing to compare against yet: keep probing until traffic arrives
        else:
            self.last_reason = f"probe abandoned ({n} samples)"
        self.probes += 1
        self._probing = False
        self._floor_windows = 0
        self._next_probe = (now + s.probe_interval_s * (1 + self._rng.uniform(0, s.probe_jitter))
                            if s.probe_interval_s > 0 else None)
        self._reset_window(now)

    def _close_window(self, now: float, overloaded: bool) -> None:
        s = self.s
        self.windows += 1
        old = self._limit
        new = old
        if self._win_drop:
            new = old * s.drop_backoff
            self.last_reason = "drop"
        elif self.baseline_s is not None and len(self._win_ok) >= min(s.window_floor_samples, s.window_min_samples):
            sample = quantile(sorted(self._win_ok), s.percentile)
            base = self.baseline_s
            target = base + max(s.buffer * base, s.buffer_min_s)
            g = min(max(target / sample, s.gradient_min), s.gradient_max) if sample > 0 else s.gradient_max
            self.last_gradient, self.last_sample_s = g, sample
            grown = old * g
            if g >= s.headroom_min_gradient:
                grown += math.sqrt(grown)
            if grown > old:
                if self._win_max_inflight < s.app_limited_ratio * old:
                    new, self.last_reason = old, "app-limited"
                else:
                    new = min(grown, max(old, s.growth_cap_factor * self._win_max_inflight))
                    self.last_reason = "increase"
            else:
                w = 1.0 if overloaded else s.decrease_smoothing
                new = old + w * (grown - old)
                self.last_reason = "decrease"
        else:
            self.last_reason = "hold (few samples)"
        self._limit = min(max(new, s.min_limit), s.max_limit)
        self._reset_window(now)
        if self._limit <= s.min_limit + 1e-9:
            self._floor_windows += 1
            if self._floor_windows >= s.floor_windows_before_probe:
                self.start_probe(now, forced=True)
        else:
            self._floor_windows = 0
