"""L2: the supervisor's per-node limits loop (every ≥ 3 s): leases, SLO guard, Vegas rate mode.

Pure: the supervisor aggregates its workers' Stats into a ``NodeWindow`` and
calls ``update(now, window)``; the loop returns a ``LimitsDecision`` (per-slot
ceiling, rate, burst, lease) stamped with an epoch and who/why, to push as
``SetLimits``.  One loop per NUMA node.

- **Leases** (Doorman): ceiling ``C_i = FAIR_SHARE(budget, demand_i)`` plus an
  equal share of what is left; ``demand_i = min(L1_i, max in-flight + queued)``;
  ``budget = Σ L1_i``, capped by the SLO guard.  Workers enforce ``min(L1, C_i)``
  and fall back to a safe ceiling when the lease (10 s) is not renewed.
  Workers on the "cpu" limiter (the default) run no L1: they get no ceiling
  at all (a stream or an await must never meet a concurrency cap) unless the
  SLO guard or an operator sets one.
- **SLO guard** (the documents' rule, made robust): node p90 *server-side
  delay* (``slo_signal = "delay"``: how long requests waited for the worker's
  loop — arrival to start, and the loop's lag — which a long stream or an
  await cannot inflate) above the SLO for 2 windows → all ceilings × 0.9 per
  window, node floor 5; below 0.8 × SLO for 2 windows → +10 % per window until
  released.  ``slo_signal = "total"`` reads total latency, the documents'
  literal rule (a 1 s stream then reads as a 1 s latency).
- **Vegas** (the documents' rule, ``mode = "vegas"``): node token-bucket rate,
  ``rtt − min_rtt`` < 5 ms → +10 %, > 20 ms → −25 %, else hold, where ``rtt``
  is the server-side delay (``vegas_signal = "delay"``, default) or the total
  latency (``"total"``, the literal reading); ≥ 100 requests of
  warm-up and per decision (``rtt`` = mean total latency of a window of ≥ 100
  completions, merged over 3 s intervals until reached); 10 % burst.  ``vegas_scaled`` (default) compares the window mean
  with the minimum window mean of the last 10 min and scales the thresholds to
  ``max(5 ms, 0.1·base)`` / ``max(20 ms, 0.5·base)``, and does not increase
  while the admitted rate is below half the rate: the unscaled rule collapses
  for long service times (FACTS-limits-leaks §8.1).
- **Operator overrides** (node or slot) win until cleared ("auto").
"""

from __future__ import annotations

import math
from collections import deque
from typing import Literal, Sequence

import msgspec

from numaserve.loops.checks import at_least, fraction, ordered, positive

__all__ = [
    "LimitsDecision",
    "LimitsLoop",
    "LimitsSettings",
    "NodeWindow",
    "SlotLimits",
    "WorkerWindow",
    "fair_share",
]

Mode = Literal["auto", "gradient", "vegas", "static", "off"]
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


class LimitsSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``[limits]`` config section (FACTS-limits-leaks §9.4)."""

    mode: Mode = "auto"                  # "gradient" is the same (kept for old configs)
    interval_s: float = 3.0
    lease_s: float = 10.0
    worker_floor: int = 2
    worker_ceiling: int = 256
    node_floor: int = 5
    static_concurrency: int = 0          # mode "static": per-worker ceiling (0: worker_ceiling)
    static_rate: float = 0.0             # mode "static": node rate, requests/s (0: none)
    burst_fraction: float = 0.1
    # SLO guard (modes gradient and vegas)
    slo_guard: bool = True
    slo_signal: Signal = "delay"
    slo_ms: float = 200.0
    slo_windows: int = 2
    slo_backoff: float = 0.9
    slo_release_ratio: float = 0.8
    slo_release_step: float = 0.1
    # Vegas rate mode
    vegas_scaled: bool = True
    vegas_signal: Signal = "delay"
    vegas_initial_rps: float = 0.0       # 0: the observed completion rate when warm-up ends
    vegas_min_rps: float = 1.0
    vegas_max_rps: float = 1_000_000.0
    vegas_warmup_requests: int = 100
    vegas_min_window_requests: int = 100  # a decision needs this many completions (windows merge until then)
    vegas_low_ms: float = 5.0
    vegas_high_ms: float = 20.0
    vegas_low_ratio: float = 0.1         # scaled: low = max(low_ms, ratio × base)
    vegas_high_ratio: float = 0.5        # scaled: high = max(high_ms, ratio × base)
    vegas_increase: float = 0.10
    vegas_decrease: float = 0.25
    vegas_rebase_s: float = 600.0
    vegas_app_limited_ratio: float = 0.5

    def __post_init__(self) -> None:
        positive(self, "interval_s", "lease_s", "slo_ms", "vegas_min_rps", "vegas_max_rps", "vegas_rebase_s")
        at_least(self, 1, "worker_floor", "worker_ceiling", "node_floor", "slo_windows")
        at_least(self, 0, "static_concurrency", "static_rate", "burst_fraction", "vegas_initial_rps",
                 "vegas_warmup_requests", "vegas_min_window_requests", "vegas_low_ms", "vegas_high_ms",
                 "vegas_low_ratio", "vegas_high_ratio", "vegas_increase", "slo_release_step")
        fraction(self, "slo_backoff", "vegas_decrease", low_open=True, high_open=True)
        fraction(self, "slo_release_ratio", "vegas_app_limited_ratio")
        ordered(self, "interval_s", "lease_s")
        ordered(self, "worker_floor", "worker_ceiling")
        ordered(self, "vegas_min_rps", "vegas_max_rps")
        ordered(self, "vegas_low_ms", "vegas_high_ms")


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
    min_total_s: float | None = None     # smallest single total latency (unscaled Vegas)
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
        self._min_rtt: float | None = None
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
        if mode in ("auto", "gradient", "vegas") and self.s.slo_guard:
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
        lo, mean = w.minimum(s.vegas_signal), w.mean(s.vegas_signal)
        if lo is not None:
            self._min_rtt = lo if self._min_rtt is None else min(self._min_rtt, lo)
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
        if s.vegas_scaled:
            base = min(m for _, m in self._means)
            low = max(s.vegas_low_ms / 1e3, s.vegas_low_ratio * base)
            high = max(s.vegas_high_ms / 1e3, s.vegas_high_ratio * base)
        else:
            base = self._min_rtt if self._min_rtt is not None else min(m for _, m in self._means)
            low, high = s.vegas_low_ms / 1e3, s.vegas_high_ms / 1e3
        diff = cur - base
        if diff < low:
            if s.vegas_scaled and admitted_rate < s.vegas_app_limited_ratio * self.rate:
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
