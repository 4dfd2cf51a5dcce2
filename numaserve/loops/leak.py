"""Leak detector: a robust memory slope per request and per second, with caps.

Pure data in, verdict out: the supervisor feeds ``observe(now, requests, rss,
uss)`` from ``/proc`` (RSS every 1 s, USS every ~10 s) and calls
``evaluate(now)``; nothing here reads the clock, sleeps or does I/O.

Why not the source documents' rule (RSS growth over 1000 requests < 10 MB) as a
trigger: it fires on healthy workers (warm-up caches, allocator high-water
marks, spikes; FACTS-limits-leaks §8.2).  Its 10 MB/1000 requests is the
*threshold scale* of a Theil–Sen slope over a 5,000-request window, flagged
only with significance (CI, Kendall), no flattening and growth spread over the
window, for 3 consecutive evaluations, and confirmed after a gc+malloc_trim.
Caps (soft/hard, fractions of a per-worker budget) act regardless of trend.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal

import msgspec

from numaserve.loops.checks import SettingError, fraction, ordered
from numaserve.loops.trend import median, median_filter, theil_sen, theil_sen_slope

__all__ = [
    "Evidence",
    "LeakDetector",
    "LeakConfig",
    "LeakSettings",
    "Trend",
    "Verdict",
    "detector_settings",
    "resolve_budget",
]

MiB = 1 << 20

VerdictKind = Literal["ok", "warming", "suspect", "leak", "soft_cap", "hard_cap"]
Metric = Literal["rss", "uss"]
Axis = Literal["requests", "seconds"]


#: Smallest ``leak.window_requests``: over fewer requests a few large responses move RSS more than a
#: leak does (10 points of 50 requests; the fit still takes ``min_points`` points however short the window).
MIN_WINDOW_REQUESTS = 500


class LeakConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``[leak]`` config section: what an operator decides.

    Whether to recycle leaking workers at all, the slope that counts as a leak
    and the requests it is fitted over, and the memory a worker may use (the
    budget, and the soft/hard caps as shares of it).  How the slope is fitted
    and judged, and how recycles are paced, is fixed in ``LeakSettings``.
    """

    enabled: bool = True
    threshold_bytes_per_1000: int = 10 * MiB   # growth per 1000 requests that flags a leak
    window_requests: int = 5000    # the slope is fitted over the last this many requests
    budget_bytes: int = 0          # 0: MemTotal × 0.8 / workers
    soft_cap: float = 0.80         # graceful recycle at this share of the budget
    hard_cap: float = 0.95         # SIGKILL at this share of the budget

    def __post_init__(self) -> None:
        if self.threshold_bytes_per_1000 < 1:
            raise SettingError("threshold_bytes_per_1000", self.threshold_bytes_per_1000, "an integer >= 1 (bytes)")
        if self.window_requests < MIN_WINDOW_REQUESTS:
            raise SettingError("window_requests", self.window_requests,
                               f"an integer >= {MIN_WINDOW_REQUESTS} (the fit needs points to judge)")
        if self.budget_bytes < 0:
            raise SettingError("budget_bytes", self.budget_bytes, "an integer >= 0 (0: MemTotal × 0.8 / workers)")
        fraction(self, "soft_cap", "hard_cap", low_open=True)
        ordered(self, "soft_cap", "hard_cap")


class LeakSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every number the detector and the leak watch use; not config keys.

    The defaults are the fixed tuning (FACTS-limits-leaks §10); ``[leak]``
    (``LeakConfig``) sets ``enabled``, ``budget_bytes`` and the caps through
    ``detector_settings``.  Tests pass a scaled-down copy.
    """

    enabled: bool = True
    # Grace: no trend verdict before both are reached (warm-up, lazy imports, caches).
    grace_requests: int = 2000
    grace_seconds: float = 120.0
    # Request axis: last N requests, one point per step (median of its samples).
    window_requests: int = 5000
    step_requests: int = 50
    min_points: int = 30           # the window reaches back further at high request rates
    max_points: int = 100          # bounds the O(n²) fit
    median_width: int = 5          # pre-filter over the downsampled points (spikes)
    # Flag rules (all must hold).  "MB" here is MiB: RSS tools report KiB/MiB.
    threshold_bytes_per_1000: int = 10 * MiB   # the documents' 10 MB / 1000 requests
    ci_lower_bytes_per_1000: int = 5 * MiB     # 95 % CI lower bound of the slope
    p_value: float = 0.01                      # Kendall tau > 0 with p below this
    flattening_ratio: float = 0.5              # 2nd-half slope ≥ ratio × 1st-half slope
    quarter_fraction: float = 0.25             # a quarter "grows" at ≥ fraction × max(threshold, slope)
    quarters_required: int = 3                 # ... in at least this many of the 4 quarters
    # Time-axis twin (timer/background leaks): bytes/s over 20 min vs "soft cap within 6 h".
    time_axis: bool = True
    time_window_s: float = 1200.0
    time_step_s: float = 20.0
    time_min_span_s: float = 1080.0            # the window must be ≥ 90 % covered
    time_horizon_s: float = 6 * 3600.0
    time_min_bytes_per_hour: int = 64 * MiB    # ignore slower growth even near the soft cap
    # Persistence and cadence.
    persistence: int = 3                       # consecutive flagged evaluations
    eval_every_requests: int = 500
    eval_every_seconds: float = 30.0
    # Confirmation: gc + malloc_trim in the worker, re-measure (see ``after_trim``).
    trim_before_verdict: bool = True
    trim_reclaim_fraction: float = 0.5         # trim undid ≥ this share of the window's rise
    # Caps regardless of trend (fractions of the per-worker budget).
    budget_bytes: int = 0                      # 0: MemTotal × budget_memtotal_fraction / workers
    budget_memtotal_fraction: float = 0.8
    soft_cap: float = 0.80                     # graceful recycle
    hard_cap: float = 0.95                     # SIGKILL
    soft_cap_samples: int = 3                  # consecutive samples at/over the soft cap
    cap_metric: Metric = "rss"
    use_uss: bool = True                       # run the trend tests on USS too; act on the larger
    # Recycling budget (supervisor): never two at once per node, spaced, bounded per hour.
    recycle_spacing_s: float = 60.0            # at least this long between leak recycles on a node
    recycle_worker_min_s: float = 900.0        # a worker is recycled for a leak at most this often
    recycle_per_hour: int = 0                  # per node; 0: max(1, workers on the node / 2)
    # a confirmed leak that has grown this much since its worker started is recycled despite the hourly
    # budget and recycle_worker_min_s (one at a time per node and recycle_spacing_s still hold)
    recycle_anyway_bytes: int = 256 * MiB
    overload_shed_fraction: float = 0.05       # no trend recycle while the node sheds more than this
    uss_interval_s: float = 10.0               # USS/PSS sampling interval (smaps_rollup)

    def __post_init__(self) -> None:
        problems = []
        if self.step_requests < 1 or self.window_requests < self.step_requests:
            problems.append("need 1 ≤ step_requests ≤ window_requests")
        if self.min_points < 8 or self.max_points < self.min_points:
            problems.append("need 8 ≤ min_points ≤ max_points")
        if not 0 < self.p_value < 1:
            problems.append("p_value must be in (0, 1)")
        if not 0 < self.soft_cap <= self.hard_cap:
            problems.append("need 0 < soft_cap ≤ hard_cap")
        if self.persistence < 1 or self.time_step_s <= 0 or self.eval_every_requests < 1:
            problems.append("persistence, time_step_s and eval_every_requests must be positive")
        if not 1 <= self.quarters_required <= 4:
            problems.append("quarters_required must be in 1..4")
        if problems:
            raise ValueError("; ".join(problems))


#: The fixed tuning the supervisor runs with (tests replace it with a scaled-down copy).
DETECTOR = LeakSettings()


def detector_settings(cfg: LeakConfig, base: LeakSettings | None = None) -> LeakSettings:
    """The detector's settings: the fixed tuning (``DETECTOR``) with the operator's ``[leak]`` keys.

    The slope's confidence bound follows the threshold (half of it, as the
    defaults: 5 MiB for 10 MiB) so a lower threshold is not held back by it.
    """
    return msgspec.structs.replace(
        DETECTOR if base is None else base, enabled=cfg.enabled,
        threshold_bytes_per_1000=cfg.threshold_bytes_per_1000, ci_lower_bytes_per_1000=cfg.threshold_bytes_per_1000 // 2,
        window_requests=cfg.window_requests, budget_bytes=cfg.budget_bytes, soft_cap=cfg.soft_cap,
        hard_cap=cfg.hard_cap)


def resolve_budget(settings: LeakSettings, mem_total_bytes: int, workers: int) -> int:
    """Per-worker memory budget: the explicit setting, else MemTotal × fraction / workers."""
    if settings.budget_bytes > 0:
        return settings.budget_bytes
    return int(mem_total_bytes * settings.budget_memtotal_fraction / max(1, workers))


class Trend(msgspec.Struct, frozen=True, kw_only=True):
    """One trend test: one metric on one axis, with every number that decided it.

    Slopes are in ``unit``: bytes per 1000 requests (axis "requests") or bytes
    per minute (axis "seconds").
    """

    metric: Metric
    axis: Axis
    unit: str
    points: int
    span_requests: float
    span_seconds: float
    slope: float
    ci_low: float
    ci_high: float
    tau: float
    p_value: float
    threshold: float
    flattening_ratio: float | None = None   # 2nd-half / 1st-half slope (None: not computed)
    quarter_slopes: list[float] | None = None
    level_at_end: float = 0.0               # fitted bytes at the window's last point
    rise: float = 0.0                       # slope × span, bytes
    failed: list[str] = []                  # checks that failed
    flagged: bool = False


class Evidence(msgspec.Struct, kw_only=True):
    """What a verdict was decided on (headline numbers from the deciding trend)."""

    rss_bytes: int = 0
    uss_bytes: int | None = None
    requests: int = 0                       # since spawn
    age_s: float = 0.0
    metric: Metric | None = None            # headline trend
    axis: Axis | None = None
    slope_per_1000_requests: float | None = None
    ci_per_1000_requests: list[float] | None = None   # [low, high], request axis only
    slope_per_minute: float | None = None
    p_value: float | None = None
    tau: float | None = None
    flattening_ratio: float | None = None
    quarter_slopes: list[float] | None = None          # in the headline trend's unit
    window_requests: float = 0.0
    window_seconds: float = 0.0
    points: int = 0
    threshold_per_1000_requests: float = 0.0
    time_threshold_per_minute: float | None = None
    budget_bytes: int = 0
    trim_rss_bytes: int | None = None       # RSS re-measured after the worker's trim
    trim_uss_bytes: int | None = None
    trends: list[Trend] = []


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """A decision plus its evidence.

    ``trim`` asks the supervisor to send ``Trim()`` to the worker, re-measure
    and call ``after_trim``; only then does a trend become ``leak``.
    ``reason`` codes: disabled, grace, insufficient-data, no-trend, trend-req,
    trend-time, trim-reclaimed, soft-cap, hard-cap.
    """

    kind: VerdictKind
    reason: str
    detail: str
    at: float
    streak: int = 0
    trim: bool = False
    evidence: Evidence = msgspec.field(default_factory=Evidence)


class _Point(msgspec.Struct, array_like=True):
    x: float   # mean axis value of the bucket (requests or seconds since spawn)
    t: float   # mean seconds since spawn
    r: float   # mean requests since spawn
    y: float   # median bytes


class _Series:
    """Samples bucketed on an axis (fixed width), one median point per bucket."""

    __slots__ = ("width", "done", "key", "xs", "ts", "rs", "ys")

    def __init__(self, width: float, keep: int) -> None:
        self.width = width
        self.done: deque[_Point] = deque(maxlen=keep)
        self.key: int | None = None
        self.xs: list[float] = []
        self.ts: list[float] = []
        self.rs: list[float] = []
        self.ys: list[float] = []

    def _close(self) -> None:
        if self.ys:
            n = len(self.ys)
            self.done.append(_Point(sum(self.xs) / n, sum(self.ts) / n, sum(self.rs) / n, median(self.ys)))
        self.xs, self.ts, self.rs, self.ys = [], [], [], []

    def add(self, x: float, t: float, r: float, y: float) -> None:
        key = math.floor(x / self.width)
        if key != self.key:
            self._close()
            self.key = key
        self.xs.append(x)
        self.ts.append(t)
        self.rs.append(r)
        self.ys.append(y)

    def points(self) -> list[_Point]:
        pts = list(self.done)
        if self.ys:
            n = len(self.ys)
            pts.append(_Point(sum(self.xs) / n, sum(self.ts) / n, sum(self.rs) / n, median(self.ys)))
        return pts

    def clear(self) -> None:
        self.done.clear()
        self.key = None
        self.xs, self.ts, self.rs, self.ys = [], [], [], []


def _fmt_mb(b: float) -> str:
    return f"{b / MiB:.1f} MB"


class LeakDetector:
    """One worker's leak detector (create a new one per worker generation).

    Usage (supervisor): ``observe`` every sample; ``evaluate`` as often as
    convenient (the trend runs only when due: every ``eval_every_requests``
    or ``eval_every_seconds``; caps are checked on every call).  On a verdict
    with ``trim=True``: send Trim, re-measure, ``after_trim``.
    """

    def __init__(self, settings: LeakSettings, now: float, *, budget_bytes: int = 0, requests_at_spawn: int = 0) -> None:
        self.s = settings
        self.spawn_t = now
        self.spawn_req = requests_at_spawn
        self.budget = budget_bytes if budget_bytes > 0 else settings.budget_bytes
        s = settings
        width = max(float(s.step_requests), s.window_requests / s.max_points)
        keep = 4 * s.max_points
        tkeep = int(s.time_window_s / s.time_step_s) + 4
        self._req = {"rss": _Series(width, keep), "uss": _Series(width, keep)}
        self._time = {"rss": _Series(s.time_step_s, tkeep), "uss": _Series(s.time_step_s, tkeep)}
        self._rss = 0
        self._uss: int | None = None
        self._requests = 0
        self._t = now
        self._soft_count = 0
        self._streak = 0
        self._trimmed = False
        self._last_eval_t = now
        self._last_eval_req = 0
        self._last_req_axis_req = -1
        self._req_trends: list[Trend] = []
        self._last: Verdict = Verdict(kind="warming", reason="grace", detail="no samples yet", at=now,
                                      evidence=self._evidence(None, []))

    # --- input ----------------------------------------------------------------------

    @property
    def soft_cap_bytes(self) -> int:
        return int(self.budget * self.s.soft_cap) if self.budget > 0 else 0

    @property
    def hard_cap_bytes(self) -> int:
        return int(self.budget * self.s.hard_cap) if self.budget > 0 else 0

    def observe(self, now: float, requests_total: int, rss_bytes: int, uss_bytes: int | None = None) -> None:
        """Record one sample: the worker's request counter and its memory."""
        req = requests_total - self.spawn_req
        if req < self._requests:  # counter went backwards: a new process behind this slot
            self.reset(now, 0)
            req = requests_total
        self._requests = req
        self._t = now
        self._rss = int(rss_bytes)
        age = now - self.spawn_t
        self._req["rss"].add(req, age, req, rss_bytes)
        self._time["rss"].add(age, age, req, rss_bytes)
        if uss_bytes is not None:
            self._uss = int(uss_bytes)
            self._req["uss"].add(req, age, req, uss_bytes)
            self._time["uss"].add(age, age, req, uss_bytes)
        cap_value = self._uss if (self.s.cap_metric == "uss" and self._uss is not None) else self._rss
        soft = self.soft_cap_bytes
        self._soft_count = self._soft_count + 1 if soft and cap_value >= soft else 0

    def reset(self, now: float, requests_total: int = 0) -> None:
        """Start over (a new process or a counter reset): history, streak and grace."""
        self.spawn_t = now
        self.spawn_req = requests_total
        for series in (*self._req.values(), *self._time.values()):
            series.clear()
        self._requests = 0
        self._soft_count = 0
        self._streak = 0
        self._trimmed = False
        self._last_eval_t = now
        self._last_eval_req = 0
        self._last_req_axis_req = -1
        self._req_trends = []
        self._last = Verdict(kind="warming", reason="grace", detail="reset", at=now, evidence=self._evidence(None, []))

    # --- decision ---------------------------------------------------------------------

    def due(self, now: float) -> bool:
        """Whether ``evaluate`` would run the trend tests now."""
        return (self._requests - self._last_eval_req >= self.s.eval_every_requests
                or now - self._last_eval_t >= self.s.eval_every_seconds)

    def evaluate(self, now: float) -> Verdict:
        """Caps on every call; the trend tests when due (else the last trend verdict)."""
        if self.due(now):
            self._last = self._evaluate_trend(now)
        return self._check_caps(now) or self._last

    def after_trim(self, now: float, rss_bytes: int, uss_bytes: int | None = None) -> Verdict:
        """The worker ran gc + malloc_trim; decide on the re-measured memory.

        If memory fell below the fitted trend by at least ``trim_reclaim_fraction``
        of the window's rise, the growth was allocator retention, not a leak:
        persistence resets and the pre-trim history (a different level) is
        dropped.  Otherwise the leak is confirmed.
        """
        primary = self._primary([t for t in self._current_trends() if t.flagged])
        ev = self._evidence(primary, self._current_trends())
        ev.trim_rss_bytes = int(rss_bytes)
        ev.trim_uss_bytes = None if uss_bytes is None else int(uss_bytes)
        if primary is None or self._streak < self.s.persistence:
            self._last = Verdict(kind="ok" if self._streak == 0 else "suspect", reason="no-trend",
                                 detail="trim result ignored: no confirmed trend", at=now,
                                 streak=self._streak, evidence=ev)
            return self._last
        after = uss_bytes if (primary.metric == "uss" and uss_bytes is not None) else rss_bytes
        limit = primary.level_at_end - self.s.trim_reclaim_fraction * primary.rise
        if after <= limit:
            self._streak = 0
            self._trimmed = False
            for series in (*self._req.values(), *self._time.values()):
                series.clear()
            self._req_trends = []
            self._last_req_axis_req = -1
            self._last = Verdict(
                kind="ok", reason="trim-reclaimed", at=now, evidence=ev,
                detail=(f"trim brought {primary.metric} to {_fmt_mb(after)}, below the trend "
                        f"({_fmt_mb(primary.level_at_end)}) by more than "
                        f"{self.s.trim_reclaim_fraction:.0%} of the window's rise; history reset"))
            return self._last
        self._trimmed = True
        self._last = self._trend_verdict(now, primary, ev, trim=False)
        return self._last

    # --- internals ------------------------------------------------------------------------

    def _current_trends(self) -> list[Trend]:
        return self._last.evidence.trends if self._last.evidence else []

    def _check_caps(self, now: float) -> Verdict | None:
        if self.budget <= 0:
            return None
        value = self._uss if (self.s.cap_metric == "uss" and self._uss is not None) else self._rss
        trends = self._current_trends()
        if value >= self.hard_cap_bytes:
            return Verdict(kind="hard_cap", reason="hard-cap", at=now, streak=self._streak,
                           evidence=self._evidence(self._primary(trends), trends),
                           detail=(f"{self.s.cap_metric} {_fmt_mb(value)} ≥ hard cap {_fmt_mb(self.hard_cap_bytes)} "
                                   f"({self.s.hard_cap:.0%} of {_fmt_mb(self.budget)})"))
        if self._soft_count >= self.s.soft_cap_samples:
            return Verdict(kind="soft_cap", reason="soft-cap", at=now, streak=self._streak,
                           evidence=self._evidence(self._primary(trends), trends),
                           detail=(f"{self.s.cap_metric} {_fmt_mb(value)} ≥ soft cap {_fmt_mb(self.soft_cap_bytes)} "
                                   f"({self.s.soft_cap:.0%} of {_fmt_mb(self.budget)}) for "
                                   f"{self._soft_count} samples"))
        return None

    def _evaluate_trend(self, now: float) -> Verdict:
        s = self.s
        self._last_eval_t = now
        self._last_eval_req = self._requests
        age = now - self.spawn_t
        if not s.enabled:
            return Verdict(kind="ok", reason="disabled", detail="leak detection disabled", at=now,
                           evidence=self._evidence(None, []))
        req_grace = self._requests < s.grace_requests
        time_grace = age < s.grace_seconds
        # The request axis needs both graces; the time axis (timer leaks, idle workers) only the time.
        if time_grace or (req_grace and not (s.time_axis and self.budget > 0)):
            return Verdict(kind="warming", reason="grace", at=now, evidence=self._evidence(None, []),
                           detail=(f"grace: {self._requests}/{s.grace_requests} requests, "
                                   f"{age:.0f}/{s.grace_seconds:.0f} s"))
        metrics: list[Metric] = ["rss", "uss"] if s.use_uss else ["rss"]
        # Request axis: only re-run on new requests (an idle worker adds no evidence).
        fresh_req = not req_grace and self._requests > self._last_req_axis_req
        if fresh_req:
            self._last_req_axis_req = self._requests
            self._req_trends = [t for m in metrics if (t := self._request_trend(m)) is not None]
        time_trends = [t for m in metrics if (t := self._time_trend(m)) is not None] if s.time_axis else []
        trends = self._req_trends + time_trends
        flagged = [t for t in trends if t.flagged]
        fresh_flag = any(t.flagged for t in time_trends) or (fresh_req and any(t.flagged for t in self._req_trends))
        if not flagged:
            self._streak = 0
            self._trimmed = False
        elif fresh_flag:
            self._streak += 1
        primary = self._primary(flagged) or self._primary(trends)
        ev = self._evidence(primary, trends)
        if not trends:
            return Verdict(kind="warming", reason="insufficient-data", at=now, evidence=ev,
                           detail=(f"request axis: {'grace' if req_grace else f'fewer than {s.min_points} points'}; "
                                   f"time axis: {'off' if not (s.time_axis and self.budget > 0) else 'window not covered yet'}"))
        if not flagged:
            return Verdict(kind="ok", reason="no-trend", at=now, evidence=ev, detail=self._describe(primary))
        assert primary is not None
        need_trim = s.trim_before_verdict and not self._trimmed and self._streak >= s.persistence
        return self._trend_verdict(now, primary, ev, trim=need_trim)

    def _trend_verdict(self, now: float, primary: Trend, ev: Evidence, *, trim: bool) -> Verdict:
        s = self.s
        reason = "trend-req" if primary.axis == "requests" else "trend-time"
        confirmed = self._streak >= s.persistence and not trim
        kind: VerdictKind = "leak" if confirmed else "suspect"
        tail = f"{min(self._streak, s.persistence)}/{s.persistence} consecutive evaluations"
        if trim:
            tail += "; trim requested before the verdict"
        elif confirmed and ev.trim_rss_bytes is not None:
            tail += f"; after trim {_fmt_mb(ev.trim_rss_bytes)} (trend {_fmt_mb(primary.level_at_end)})"
        return Verdict(kind=kind, reason=reason, at=now, streak=self._streak, trim=trim, evidence=ev,
                       detail=f"{self._describe(primary)}; {tail}")

    @staticmethod
    def _describe(t: Trend | None) -> str:
        if t is None:
            return "no trend computed"
        unit = "1000 requests" if t.axis == "requests" else "minute"
        parts = [f"{t.metric} {_fmt_mb(t.slope)}/{unit} (95% CI {_fmt_mb(t.ci_low)}..{_fmt_mb(t.ci_high)}, "
                 f"threshold {_fmt_mb(t.threshold)})", f"tau {t.tau:.2f} p={t.p_value:.2g}"]
        if t.flattening_ratio is not None:
            parts.append(f"halves ratio {t.flattening_ratio:.2f}")
        if t.quarter_slopes is not None:
            parts.append("quarters " + "/".join(f"{q / MiB:.1f}" for q in t.quarter_slopes))
        parts.append(f"{t.points} points over {t.span_requests:.0f} requests / {t.span_seconds:.0f} s")
        if t.failed:
            parts.append("failed: " + ",".join(t.failed))
        return ", ".join(parts)

    def _primary(self, trends: list[Trend]) -> Trend | None:
        """The trend to act on and report: the largest slope relative to its threshold."""
        if not trends:
            return None
        return max(trends, key=lambda t: (t.slope / t.threshold if t.threshold > 0 else 0.0))

    def _request_trend(self, metric: Metric) -> Trend | None:
        s = self.s
        pts = self._req[metric].points()
        if len(pts) < s.min_points:
            return None
        last = pts[-1].x
        sel = [p for p in pts if p.x >= last - s.window_requests]
        if len(sel) < s.min_points:
            sel = pts[-s.min_points :]
        sel = sel[-s.max_points :]
        scale = 1000.0
        return self._trend(metric, "requests", sel, scale, s.threshold_bytes_per_1000,
                           s.ci_lower_bytes_per_1000, "bytes/1000 requests")

    def _time_threshold_per_s(self) -> float | None:
        if self.budget <= 0:
            return None
        soft = self.soft_cap_bytes
        current = max(self._rss, self._uss or 0)
        return max((soft - current) / self.s.time_horizon_s, self.s.time_min_bytes_per_hour / 3600.0)

    def _time_trend(self, metric: Metric) -> Trend | None:
        s = self.s
        per_s = self._time_threshold_per_s()
        if per_s is None:
            return None
        pts = self._time[metric].points()
        last = pts[-1].x if pts else 0.0
        sel = [p for p in pts if p.x >= last - s.time_window_s]
        if len(sel) < 8 or sel[-1].x - sel[0].x < s.time_min_span_s:
            return None
        threshold = per_s * 60.0
        ci_lower = threshold * s.ci_lower_bytes_per_1000 / s.threshold_bytes_per_1000
        return self._trend(metric, "seconds", sel[-s.max_points :], 60.0, threshold, ci_lower, "bytes/minute")

    def _trend(self, metric: Metric, axis: Axis, pts: list[_Point], scale: float, threshold: float,
               ci_lower: float, unit: str) -> Trend:
        """Run every check on one series; structural checks only once the slope qualifies."""
        s = self.s
        xs = [p.x for p in pts]
        ys = median_filter([p.y for p in pts], s.median_width)
        fit = theil_sen(xs, ys)
        slope = fit.slope * scale
        failed = []
        if slope < threshold:
            failed.append("slope")
        if fit.ci_low * scale < ci_lower:
            failed.append("ci")
        if not (fit.tau > 0 and fit.p_value < s.p_value):
            failed.append("kendall")
        ratio: float | None = None
        quarters: list[float] | None = None
        if not failed:
            n = len(xs)
            h = n // 2
            s1 = theil_sen_slope(xs[:h], ys[:h])
            s2 = theil_sen_slope(xs[h:], ys[h:])
            ratio = s2 / s1 if s1 > 0 else math.inf
            if ratio < s.flattening_ratio:
                failed.append("flattening")
            bounds = [round(i * n / 4) for i in range(5)]
            quarters = [theil_sen_slope(xs[a:b], ys[a:b]) * scale for a, b in zip(bounds, bounds[1:])]
            floor = s.quarter_fraction * max(threshold, slope)
            if sum(q >= floor for q in quarters) < s.quarters_required:
                failed.append("spread")
        level_end = fit.intercept + fit.slope * xs[-1]
        return Trend(
            metric=metric, axis=axis, unit=unit, points=len(pts),
            span_requests=pts[-1].r - pts[0].r, span_seconds=pts[-1].t - pts[0].t,
            slope=slope, ci_low=fit.ci_low * scale, ci_high=fit.ci_high * scale,
            tau=fit.tau, p_value=fit.p_value, threshold=threshold,
            flattening_ratio=None if ratio is None or math.isinf(ratio) else ratio,
            quarter_slopes=quarters, level_at_end=level_end, rise=fit.slope * (xs[-1] - xs[0]),
            failed=failed, flagged=not failed,
        )

    def _evidence(self, primary: Trend | None, trends: list[Trend]) -> Evidence:
        ev = Evidence(
            rss_bytes=self._rss, uss_bytes=self._uss, requests=self._requests,
            age_s=self._t - self.spawn_t, budget_bytes=self.budget,
            threshold_per_1000_requests=float(self.s.threshold_bytes_per_1000), trends=list(trends),
        )
        per_s = self._time_threshold_per_s()
        ev.time_threshold_per_minute = None if per_s is None else per_s * 60.0
        if primary is None:
            return ev
        ev.metric, ev.axis = primary.metric, primary.axis
        ev.p_value, ev.tau = primary.p_value, primary.tau
        ev.flattening_ratio, ev.quarter_slopes = primary.flattening_ratio, primary.quarter_slopes
        ev.window_requests, ev.window_seconds, ev.points = primary.span_requests, primary.span_seconds, primary.points
        rate = primary.span_requests / primary.span_seconds if primary.span_seconds > 0 else 0.0  # req/s
        if primary.axis == "requests":
            ev.slope_per_1000_requests = primary.slope
            ev.ci_per_1000_requests = [primary.ci_low, primary.ci_high]
            ev.slope_per_minute = primary.slope / 1000.0 * rate * 60.0
        else:
            ev.slope_per_minute = primary.slope
            ev.slope_per_1000_requests = primary.slope / 60.0 / rate * 1000.0 if rate > 0 else None
        return ev
