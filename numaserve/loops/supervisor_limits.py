"""L2: the supervisor's per-node limits loop (every ≥ 3 s): leases, SLO guard, Vegas rate mode.

Pure: the supervisor aggregates its workers' Stats into a ``NodeWindow`` and
calls ``update(now, window)``; the loop returns a ``LimitsDecision`` (per-slot
ceiling, rate, burst, lease) stamped with an epoch and who/why, to push as
``SetLimits``.  One loop per NUMA node.

- **Leases** (Doorman): the workers' CPU gates need no concurrency cap (a
  stream or an await must never meet one), so a worker gets a ceiling only
  when the SLO guard, mode "static" or an operator sets a node budget; it is
  split as ``C_i = FAIR_SHARE(budget, demand_i)`` plus an equal share of what
  is left (``demand_i`` = max in-flight), and falls back to a safe ceiling when
  the lease (``lease_s``) is not renewed.
- **SLO guard** (the documents' rule, made robust): node p90 *server-side
  delay* (``slo_signal = "delay"``: how long requests waited for the worker's
  loop — arrival to start, and the loop's lag — which a long stream or an
  await cannot inflate) above the SLO for 2 windows → all ceilings × 0.9 per
  window, node floor 5; below 0.8 × SLO for 2 windows → +10 % per window until
  released.  ``slo_signal = "total"`` reads total latency, the documents'
  literal rule (a 1 s stream then reads as a 1 s latency).
- **Vegas** (``mode = "vegas"``): node token-bucket rate from the server-side
  delay (``vegas_signal = "delay"``, default) or the total latency (``"total"``):
  ≥ 100 requests of warm-up and per decision (window mean of ≥ 100 completions,
  merged over intervals until reached), compared with the lowest window mean
  of the last 10 min; below ``max(5 ms, 0.1·base)`` → +10 % (not while the
  admitted rate is below half the rate), above ``max(20 ms, 0.5·base)`` → −25 %;
  10 % burst.  The documents' unscaled rule (fixed 5/20 ms against the
  smallest single sample) collapsed for long service times
  (FACTS-limits-leaks §8.1) and is gone.
- **Operator overrides** (node or slot) win until cleared ("auto").
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal, Sequence

import msgspec

from numaserve.loops.checks import at_least, ordered, positive

__all__ = [
    "LimitsDecision",
    "LimitsLoop",
    "LimitsSettings",
    "NodeWindow",
    "SlotLimits",
    "WorkerWindow",
    "fair_share",
]

Mode = Literal["auto", "vegas", "static", "off"]
Signal = Literal["delay", "total"]


def fair_share(capacity: float, demands: Sequence[float]) -> list[float]:
    """Doorman FAIR_SHARE (max-min fair): nobody above its demand, the rest split evenly.

    capacity 120, demands 1000/50/10 → 60/50/10.
    """
    n = len(demands)
    alloc = [0.0] * n
    remaining = max(0.0, float(capacity))
    open_ = [i for i in range(n) if demands[i] > 0]
    while open_ and remaining > 1e-12:
        share = remaining / len(open_)
        satisfied = [i for i in open_ if demands[i] - alloc[i] <= share]
        if not satisfied:
            for i in open_:
                alloc[i] += share
            remaining = 0.0
            break
        for i in satisfied:
            remaining -= demands[i] - alloc[i]
            alloc[i] = float(demands[i])
        open_ = [i for i in open_ if i not in satisfied]
    return alloc


# Internal tuning of the limits loop (were [limits] keys; nobody had a reason to set them).
#: A worker's lease ceiling never goes below this; the node's total never below NODE_FLOOR.
WORKER_FLOOR = 2
NODE_FLOOR = 5
#: Token-bucket burst pushed with a rate, as a share of it.
BURST_FRACTION = 0.1
#: SLO guard: p90 above the SLO for SLO_WINDOWS windows → ceilings × SLO_BACKOFF per window;
#: below SLO_RELEASE_RATIO × SLO for SLO_WINDOWS windows → + SLO_RELEASE_STEP per window until released.
SLO_WINDOWS = 2
SLO_BACKOFF = 0.9
SLO_RELEASE_RATIO = 0.8
SLO_RELEASE_STEP = 0.1
#: Vegas: ≥ VEGAS_WARMUP_REQUESTS completions before the first decision, ≥ VEGAS_MIN_WINDOW_REQUESTS
#: per decision (windows merge until then); rtt − base < low → + VEGAS_INCREASE, > high → − VEGAS_DECREASE,
#: low = max(VEGAS_LOW_MS, VEGAS_LOW_RATIO × base), high = max(VEGAS_HIGH_MS, VEGAS_HIGH_RATIO × base),
#: base = the lowest window mean of the last VEGAS_REBASE_S; no increase while the admitted rate is below
#: VEGAS_APP_LIMITED_RATIO × the rate (the app, not the server, limits it).
VEGAS_WARMUP_REQUESTS = 100
VEGAS_MIN_WINDOW_REQUESTS = 100
VEGAS_LOW_MS = 5.0
VEGAS_HIGH_MS = 20.0
VEGAS_LOW_RATIO = 0.1
VEGAS_HIGH_RATIO = 0.5
VEGAS_INCREASE = 0.10
VEGAS_DECREASE = 0.25
VEGAS_REBASE_S = 600.0
VEGAS_APP_LIMITED_RATIO = 0.5


class LimitsSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``[limits]`` section: the supervisor's per-node loop that pushes one limit to each worker's gate."""

    mode: Mode = "auto"                  # "auto": SLO guard + operator; "vegas": + a node rate; "static"; "off"
    interval_s: float = 3.0              # one decision per node this often
    lease_s: float = 10.0                # a pushed ceiling holds this long unless renewed
    worker_ceiling: int = 256            # the highest ceiling the loop gives one worker
    static_concurrency: int = 0          # mode "static": per-worker ceiling (0: worker_ceiling)
    static_rate: float = 0.0             # mode "static": node rate, requests/s (0: none)
    slo_guard: bool = True               # modes auto and vegas: cap concurrency while the node's p90 > slo_ms
    slo_signal: Signal = "delay"         # "delay": server-side wait for the loop; "total": whole latency
    slo_ms: float = 200.0
    vegas_signal: Signal = "delay"
    vegas_initial_rps: float = 0.0       # 0: the observed completion rate when warm-up ends
    vegas_min_rps: float = 1.0
    vegas_max_rps: float = 1_000_000.0

    # The tuning constants, read where the settings are (``s.node_floor``): not keys.
    worker_floor = WORKER_FLOOR
    node_floor = NODE_FLOOR
    burst_fraction = BURST_FRACTION
    slo_windows = SLO_WINDOWS
    slo_backoff = SLO_BACKOFF
    slo_release_ratio = SLO_RELEASE_RATIO
    slo_release_step = SLO_RELEASE_STEP
    vegas_warmup_requests = VEGAS_WARMUP_REQUESTS
    vegas_min_window_requests = VEGAS_MIN_WINDOW_REQUESTS
    vegas_low_ms = VEGAS_LOW_MS
    vegas_high_ms = VEGAS_HIGH_MS
    vegas_low_ratio = VEGAS_LOW_RATIO
    vegas_high_ratio = VEGAS_HIGH_RATIO
    vegas_increase = VEGAS_INCREASE
    vegas_decrease = VEGAS_DECREASE
    vegas_rebase_s = VEGAS_REBASE_S
    vegas_app_limited_ratio = VEGAS_APP_LIMITED_RATIO

    def __post_init__(self) -> None:
        positive(self, "interval_s", "lease_s", "slo_ms", "vegas_min_rps", "vegas_max_rps")
        at_least(self, 1, "worker_ceiling")
        at_least(self, WORKER_FLOOR, "worker_ceiling")
        at_least(self, 0, "static_concurrency", "static_rate", "vegas_initial_rps")
        ordered(self, "interval_s", "lease_s")
        ordered(self, "vegas_min_rps", "vegas_max_rps")


class WorkerWindow(msgspec.Struct, kw_only=True):
    """One worker over the last window (deltas of its Stats counters)."""

    slot: int
    l1_limit: float | None = None        # None: the worker runs no L1 controller
    max_inflight: int = 0
    queued: int = 0
    arrivals: int = 0                    # requests that reached its gate (admitted + rejected)
    admitted: int = 0
    codel_overloaded: bool = False
    probing: bool = False


class NodeWindow(msgspec.Struct, kw_only=True):
    """The node over the last window; histograms merged exactly.

    *total* = queue + service (+ a stream's whole life); *delay* = server-side
    delay only: how long requests waited for the worker's loop (arrival →
    start) plus its lag while they ran.
    """

    duration_s: float
    completed: int = 0                   # successful responses
    admitted: int = 0
    p90_total_s: float | None = None
    mean_total_s: float | None = None
    min_total_s: float | None = None     # smallest single total latency
    p90_delay_s: float | None = None
    mean_delay_s: float | None = None
    min_delay_s: float | None = None
    workers: list[WorkerWindow] = []

    def p90(self, signal: str) -> float | None:
        return self.p90_delay_s if signal == "delay" else self.p90_total_s

    def mean(self, signal: str) -> float | None:
        return self.mean_delay_s if signal == "delay" else self.mean_total_s

    def minimum(self, signal: str) -> float | None:
        return self.min_delay_s if signal == "delay" else self.min_total_s


class SlotLimits(msgspec.Struct, kw_only=True):
    """What one worker gets (→ ``SetLimits``)."""

    slot: int
    concurrency: int | None              # lease ceiling (None: none)
    rate: float | None                   # requests/s (None: no quota)
    burst: float | None
    lease_s: float                       # valid this long from receipt ...
    lease_expiry: float                  # ... i.e. until this supervisor-monotonic time
    safe_concurrency: int | None         # ceiling after expiry
    source: str
    reason: str = ""                     # why this slot has these limits (not another slot's override)


class LimitsDecision(msgspec.Struct, kw_only=True):
    """One output of the loop; ``epoch`` grows whenever any slot's values change."""

    epoch: int
    at: float
    mode: Mode
    source: str                          # "auto: fair share", "auto: slo guard", "auto: vegas +10%", "operator", ...
    reason: str
    changed: bool
    node_budget: float | None
    node_rate: float | None
    slo_cap: float | None
    slots: list[SlotLimits]


class _Override(msgspec.Struct):
    concurrency: int | None
    rate: float | None


class LimitsLoop:
    """One node's L2 loop; see the module docstring."""

    def __init__(self, settings: LimitsSettings, now: float, *, epoch: int = 0) -> None:
        self.s = settings
        self.epoch = epoch
        self._last_update: float | None = None
        self._last_window: NodeWindow | None = None
        self.last: LimitsDecision | None = None
        self._last_key: tuple | None = None
        # SLO guard
        self.slo_cap: float | None = None
        self._over = 0
        self._under = 0
        # Vegas
        self.rate: float | None = settings.vegas_initial_rps or None
        self._seen = 0
        self._means: deque[tuple[float, float]] = deque()
        self._acc_n = 0          # Vegas window accumulated across L2 intervals
        self._acc_sum = 0.0
        self._acc_admitted = 0
        self._acc_dur = 0.0
        # Overrides: None key = node
        self._overrides: dict[int | None, _Override] = {}
        self._auto_source = "auto: fair share"

    # --- inputs ----------------------------------------------------------------------------

    def due(self, now: float) -> bool:
        return self._last_update is None or now - self._last_update >= self.s.interval_s

    def update(self, now: float, window: NodeWindow) -> LimitsDecision | None:
        """Run one window (None if called before ``interval_s`` elapsed)."""
        if not self.due(now):
            return None
        self._last_update = now
        self._last_window = window
        notes: list[str] = []
        source = "auto: fair share"
        mode = self.s.mode
        if mode in ("auto", "vegas") and self.s.slo_guard:
            slo_note = self._slo_step(window)
            if slo_note:
                source = f"auto: {slo_note}"
                notes.append(slo_note)
        if mode == "vegas":
            vnote = self._vegas_step(now, window)
            notes.append(vnote)
            if source == "auto: fair share":
                source = f"auto: {vnote}"
        self._auto_source = source
        return self._decide(now, window, source, "; ".join(n for n in notes if n))

    def _window_with(self, slots: Sequence[int]) -> NodeWindow:
        """The last window, plus a placeholder for each slot it has not seen yet (a worker that has
        not reported stats still gets an operator's override)."""
        w = self._last_window or NodeWindow(duration_s=0.0)
        have = {x.slot for x in w.workers}
        missing = [WorkerWindow(slot=x) for x in slots if x not in have]
        if not missing:
            return w
        return NodeWindow(**{**msgspec.structs.asdict(w), "workers": [*w.workers, *missing]})

    def override(self, now: float, *, slot: int | None = None, concurrency: int | None = None,
                 rate: float | None = None, slots: Sequence[int] = ()) -> LimitsDecision:
        """Operator: fix a slot's (or the node's total) concurrency and/or rate until ``clear_override``."""
        self._overrides[slot] = _Override(concurrency, rate)
        return self._decide(now, self._window_with(slots), "operator",
                            f"operator override for {'node' if slot is None else f'slot {slot}'}")

    def clear_override(self, now: float, *, slot: int | None = None, everything: bool = False,
                       slots: Sequence[int] = ()) -> LimitsDecision:
        """Back to "auto" for a slot, the node, or everything."""
        if everything:
            self._overrides.clear()
        else:
            self._overrides.pop(slot, None)
        return self._decide(now, self._window_with(slots), "auto",
                            f"override cleared for {'everything' if everything else 'node' if slot is None else f'slot {slot}'}")

    # --- SLO guard -------------------------------------------------------------------------------

    def _natural_budget(self, w: NodeWindow) -> float:
        return float(sum(min(x.l1_limit, self.s.worker_ceiling) if x.l1_limit is not None else self.s.worker_ceiling
                         for x in w.workers))

    def _slo_step(self, w: NodeWindow) -> str:
        s = self.s
        slo = s.slo_ms / 1000.0
        p90 = w.p90(s.slo_signal)
        if p90 is None or w.completed == 0:
            return ""
        if p90 > slo:
            self._over += 1
            self._under = 0
        elif p90 < s.slo_release_ratio * slo:
            self._under += 1
            self._over = 0
        else:
            self._over = self._under = 0
        natural = self._natural_budget(w)
        if self._over >= s.slo_windows:
            in_use = float(sum(max(x.max_inflight, 1) for x in w.workers)) or natural
            basis = self.slo_cap if self.slo_cap is not None else min(natural, in_use)
            self.slo_cap = max(float(s.node_floor), basis * s.slo_backoff)
            return f"slo guard ×{s.slo_backoff:g} (p90 {p90 * 1e3:.0f} ms > {s.slo_ms:g} ms)"
        if self._under >= s.slo_windows and self.slo_cap is not None:
            self.slo_cap *= 1 + s.slo_release_step
            if self.slo_cap >= natural:
                self.slo_cap = None
                return "slo guard released"
            return f"slo release +{s.slo_release_step:.0%}"
        return ""

    # --- Vegas -----------------------------------------------------------------------------------

    def _vegas_step(self, now: float, w: NodeWindow) -> str:
        s = self.s
        self._seen += w.completed
        mean = w.mean(s.vegas_signal)
        if mean is not None and w.completed > 0:
            self._acc_n += w.completed
            self._acc_sum += mean * w.completed
        self._acc_admitted += w.admitted
        self._acc_dur += w.duration_s
        if self._seen < s.vegas_warmup_requests:
            return "vegas warm-up"
        if self._acc_n < max(1, s.vegas_min_window_requests):
            return f"vegas hold ({self._acc_n} samples in window)"
        cur = self._acc_sum / self._acc_n
        admitted_rate = self._acc_admitted / self._acc_dur if self._acc_dur > 0 else 0.0
        completed_rate = self._acc_n / self._acc_dur if self._acc_dur > 0 else 0.0
        self._acc_n, self._acc_sum, self._acc_admitted, self._acc_dur = 0, 0.0, 0, 0.0
        self._means.append((now, cur))
        while self._means and now - self._means[0][0] > s.vegas_rebase_s:
            self._means.popleft()
        if self.rate is None:
            self.rate = max(s.vegas_min_rps, completed_rate)
            return f"vegas start {self.rate:.1f}/s"
        base = min(m for _, m in self._means)
        low = max(s.vegas_low_ms / 1e3, s.vegas_low_ratio * base)
        high = max(s.vegas_high_ms / 1e3, s.vegas_high_ratio * base)
        diff = cur - base
        if diff < low:
            if admitted_rate < s.vegas_app_limited_ratio * self.rate:
                return "vegas hold (app-limited)"
            self.rate = min(s.vegas_max_rps, self.rate * (1 + s.vegas_increase))
            return f"vegas +{s.vegas_increase:.0%}"
        if diff > high:
            self.rate = max(s.vegas_min_rps, self.rate * (1 - s.vegas_decrease))
            return f"vegas -{s.vegas_decrease:.0%}"
        return "vegas hold"

    # --- output ---------------------------------------------------------------------------------

    def _decide(self, now: float, w: NodeWindow, source: str, reason: str) -> LimitsDecision:
        s = self.s
        workers = w.workers
        slots = [x.slot for x in workers]
        n = len(workers)
        node_ov = self._overrides.get(None)
        budget: float | None = None
        ceilings: list[int | None]
        if s.mode == "off":
            ceilings = [None] * n
        elif s.mode == "static":
            per = s.static_concurrency or s.worker_ceiling
            ceilings = [per] * n
            budget = float(per * n)
        elif self.slo_cap is None and workers and all(x.l1_limit is None for x in workers):
            ceilings = [None] * n   # "cpu" limiters: the workers shed on CPU; no cap on streams
        else:
            natural = self._natural_budget(w)
            budget = natural if self.slo_cap is None else min(natural, self.slo_cap)
            budget = max(budget, float(s.node_floor))
            ceilings = list(self._split(budget, workers))
        if node_ov is not None and node_ov.concurrency is not None:
            budget = float(max(node_ov.concurrency, s.node_floor))
            ceilings = list(self._split(budget, workers))
        # Rates
        node_rate: float | None = None
        if s.mode == "vegas":
            node_rate = self.rate
        elif s.mode == "static" and s.static_rate > 0:
            node_rate = s.static_rate
        if node_ov is not None and node_ov.rate is not None:
            node_rate = node_ov.rate
        rates: list[float | None] = [None] * n
        if node_rate is not None and n:
            dur = w.duration_s if w.duration_s > 0 else 1.0
            want = [max(x.arrivals, x.admitted) / dur for x in workers]
            alloc = fair_share(node_rate, want)
            spare = (node_rate - sum(alloc)) / n
            rates = [a + spare for a in alloc]
        # Slot overrides win.
        sources = [self._auto_source] * n
        for i, slot in enumerate(slots):
            ov = self._overrides.get(slot)
            if ov is not None:
                if ov.concurrency is not None:
                    ceilings[i] = ov.concurrency
                if ov.rate is not None:
                    rates[i] = ov.rate
                sources[i] = "operator"
            elif node_ov is not None:
                sources[i] = "operator"
        out: list[SlotLimits] = []
        for i, slot in enumerate(slots):
            c, r = ceilings[i], rates[i]
            burst = None if r is None else max(1.0, s.burst_fraction * r)
            out.append(SlotLimits(slot=slot, concurrency=c, rate=r, burst=burst, lease_s=s.lease_s,
                                  lease_expiry=now + s.lease_s, safe_concurrency=c, source=sources[i],
                                  reason=self._slot_reason(slot, sources[i], source, reason)))
        key = tuple((x.slot, x.concurrency, None if x.rate is None else round(x.rate, 6)) for x in out)
        changed = key != self._last_key
        if changed:
            self.epoch += 1
            self._last_key = key
        if self._overrides and source != "operator":
            source = f"operator + {source}"
        self.last = LimitsDecision(epoch=self.epoch, at=now, mode=s.mode, source=source, reason=reason,
                                   changed=changed, node_budget=budget, node_rate=node_rate,
                                   slo_cap=self.slo_cap, slots=out)
        return self.last

    def _slot_reason(self, slot: int, slot_source: str, source: str, reason: str) -> str:
        """One slot's reason: its own override, else the decision's reason unless that was an
        operator action on other slots (an override or its clearing), which says nothing about this one."""
        if slot in self._overrides:
            return f"operator override for slot {slot}"
        if None in self._overrides:
            return "operator override for node"
        if source in ("operator", "auto"):
            return slot_source
        return reason or slot_source

    def _split(self, budget: float, workers: Sequence[WorkerWindow]) -> list[int]:
        """Fair share of the budget by demand, leftover split evenly, clamped to the worker range."""
        s = self.s
        n = len(workers)
        if n == 0:
            return []
        demands = []
        for x in workers:
            used = float(x.max_inflight + x.queued)
            own = float(x.l1_limit) if x.l1_limit is not None else float(s.worker_ceiling)
            demands.append(max(float(s.worker_floor), min(own, used)))
        alloc = fair_share(budget, demands)
        spare = max(0.0, budget - sum(alloc)) / n
        return _apportion([a + spare for a in alloc], s.worker_floor, s.worker_ceiling)


def _apportion(shares: Sequence[float], lo: int, hi: int) -> list[int]:
    """Whole permits from fractional shares: floors, then largest remainders, so the sum is kept."""
    base = [math.floor(x) for x in shares]
    extra = int(round(sum(shares))) - sum(base)
    order = sorted(range(len(shares)), key=lambda i: shares[i] - base[i], reverse=True)
    for i in order[: max(0, extra)]:
        base[i] += 1
    return [int(min(max(b, lo), hi)) for b in base]
