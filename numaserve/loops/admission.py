"""L0: the worker's admission gate, a pure state machine plus a thin asyncio wrapper.

Per request, in this order (FACTS-limits-leaks §9.2):
1. deadline already passed → 504;
2. token bucket (rate quota from the supervisor, burst 10 %) empty → 429 with
   Retry-After = time to the next token;
3. in-flight < limit = min(L1 limit, lease ceiling) → admitted at once;
4. wait queue (bound 1 × limit) full → 503 at once;
5. otherwise queued: FIFO, LIFO while CoDel reports a standing queue.
At dequeue (a permit freed) a waiter is shed with 503 when CoDel is
overloaded and it waited > slough (2 × target), and with 504 when its deadline
passed; a waiter also leaves after ``max_wait`` (1 × target; FACTS §9.2 says
2 × target, 1 × measured better: p99 67–69 ms instead of 74–79 ms at 3 C in
the test simulator, same goodput) with 503, or with 504 once its deadline
minus the baseline service time is reached.  CoDel target =
``clamp(0.25 × baseline service p50, 5 ms, 100 ms)``.  Overload replies carry
``Retry-After = clamp(ceil(queue_len/throughput + U(0,1)), 1, 30)``.

The machine never reads a clock and owns no futures: every call takes ``now``
and returns decisions (``Admit``/``Queued``/``Reject``, ``Grant``/``Shed``)
for the caller to act on.  ``AdmissionGate`` applies them to asyncio futures.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Union

import msgspec

from numaserve.loops.checks import at_least, fraction, ordered, positive
from numaserve.loops.gradient import GradientController, GradientSettings, L1Outcome
from numaserve.loops.trend import quantile

__all__ = [
    "Admit",
    "AdmissionGate",
    "AdmissionMachine",
    "AdmissionSettings",
    "CoDel",
    "GateStats",
    "Grant",
    "Outcome",
    "Permit",
    "PushedLimits",
    "Queued",
    "Reject",
    "Rejected",
    "Shed",
    "Ticket",
    "TokenBucket",
]

Outcome = Literal["ok", "dropped", "ignored", "bad_request"]
Limiter = Literal["cpu", "gradient", "static"]
_L1_OUTCOME: dict[str, L1Outcome] = {"ok": "ok", "dropped": "dropped", "ignored": "ignored", "bad_request": "ignored"}


class AdmissionSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The worker-side L0 gate (FACTS-limits-leaks §9.2; ``limiter = "cpu"``: ``numaserve.loops.cpu_gate``)."""

    enabled: bool = True                 # admission control in front of every worker's app
    limiter: Limiter = "cpu"             # "cpu": shed on loop lag + requests waiting for CPU (default);
                                         # "gradient": in-flight limit from service time (L1); "static"
    request_timeout_s: float = 0.0       # deadline per request when the client sends none (0: none)
    # limiter "cpu" (numaserve.loops.cpu_gate)
    lag_target_s: float = 0.010          # the loop is short of CPU while its smoothed lag is above this
    lag_smoothing: float = 0.5           # weight of a new lag sample in the smoothed lag
    cpu_concurrency: int = 2             # overloaded: admit only if fewer requests than this wait for CPU ...
    overload_wait_s: float = 0.04        # ... or what they wait for is less CPU than this
    cpu_burst: int = 8                   # short of CPU in a burst (not overloaded): the same bound ...
    burst_wait_s: float = 0.1            # ... and all of them by their expected CPU (count × CPU per request)
    busy_window_s: float = 0.5           # overloaded = the loop busy without an idle moment for the share
    busy_threshold: float = 0.95         # busy_threshold of the recent past (time constant busy_window_s) ...
    busy_release: float = 0.8            # ... and until that share falls below busy_release
    max_inflight: int = 0                # safety cap on requests in flight, streams included (0: none)
    probe_min_s: float = 0.001           # loop-lag probe period while the loop is busy ...
    probe_max_s: float = 0.008           # ... growing to this while it is idle
    sentinel: bool = True                # a thread answers 503 from the accept queue while the loop is stalled
    stall_after_s: float = 0.002         # stalled: the probe is this late (while short of CPU) ...
    stall_idle_after_s: float = 1.0      # ... or this late otherwise (a cold start, a GC pause: not overload)
    stall_queue: int = 1                 # connections left waiting in the accept queue during a stall (at least)
    close_when_overloaded: bool = False  # Connection: close on responses while shedding (clients come back
                                         # through the accept queue, where the sentinel sees them)
    overload_hold_s: float = 1.0         # "shedding" lasts this long after the last shed
    gone_check_after_s: float = 0.02     # a request that waited longer is checked for a departed client
    # limiters "gradient" and "static"
    queue_factor: float = 1.0            # wait-queue bound = ceil(factor × limit)
    queue_max: int = 4096                # absolute bound of the wait queue
    lifo_when_overloaded: bool = True
    codel_interval_s: float = 0.1
    codel_target_fraction: float = 0.25  # target = clamp(fraction × baseline p50, min, max)
    codel_target_min_s: float = 0.005
    codel_target_max_s: float = 0.1
    slough_factor: float = 2.0           # shed waiters older than factor × target while overloaded
    max_wait_factor: float = 1.0         # a waiter leaves after factor × target (0: no limit)
    burst_fraction: float = 0.1          # token-bucket burst when the supervisor sends none
    retry_after_min_s: int = 1
    retry_after_max_s: int = 30
    static_limit: int = 0                # in-flight limit without an L1 controller (0: ceiling only)
    throughput_tau_s: float = 2.0        # smoothing of the completion rate (Retry-After)
    baseline_window_s: float = 1.0       # fallback baseline without L1: min over windows of p50
    baseline_windows: int = 60

    def __post_init__(self) -> None:
        at_least(self, 0, "request_timeout_s", "queue_factor", "queue_max", "max_inflight", "stall_queue",
                 "max_wait_factor", "burst_fraction", "static_limit", "baseline_windows", "overload_hold_s",
                 "gone_check_after_s")
        positive(self, "lag_target_s", "busy_window_s", "burst_wait_s", "overload_wait_s", "probe_min_s", "probe_max_s", "stall_after_s", "stall_idle_after_s",
                 "codel_interval_s", "codel_target_min_s", "codel_target_max_s", "slough_factor",
                 "throughput_tau_s", "baseline_window_s")
        fraction(self, "lag_smoothing", "busy_threshold", "busy_release", low_open=True)
        ordered(self, "busy_release", "busy_threshold")
        fraction(self, "codel_target_fraction", low_open=True)
        at_least(self, 1, "cpu_concurrency", "cpu_burst", "retry_after_min_s")
        ordered(self, "cpu_concurrency", "cpu_burst")
        ordered(self, "probe_min_s", "probe_max_s")
        ordered(self, "stall_after_s", "stall_idle_after_s")
        ordered(self, "codel_target_min_s", "codel_target_max_s")
        ordered(self, "retry_after_min_s", "retry_after_max_s")


# --- building blocks -------------------------------------------------------------------


class TokenBucket:
    """Rate quota: at most ``rate × t + burst`` takes over any interval of length t.

    ``rate <= 0`` means unlimited.  Starts full.
    """

    __slots__ = ("rate", "burst", "tokens", "_t")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = float(rate)
        self.burst = max(1.0, float(burst))
        self.tokens = self.burst
        self._t = now

    def _refill(self, now: float) -> None:
        if now > self._t:
            self.tokens = min(self.burst, self.tokens + (now - self._t) * self.rate)
            self._t = now

    def set(self, now: float, rate: float, burst: float) -> None:
        """Change rate/burst, keeping earned tokens up to the new burst (full when it was unlimited)."""
        self._refill(now)
        was_unlimited = self.rate <= 0
        self.rate = float(rate)
        self.burst = max(1.0, float(burst))
        self.tokens = self.burst if was_unlimited else min(self.tokens, self.burst)

    def try_take(self, now: float, n: float = 1.0) -> bool:
        if self.rate <= 0:
            return True
        self._refill(now)
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False

    def wait_time(self, now: float, n: float = 1.0) -> float:
        """Seconds until ``n`` tokens are available (0 if now)."""
        if self.rate <= 0:
            return 0.0
        self._refill(now)
        return max(0.0, (n - self.tokens) / self.rate)


class CoDel:
    """folly's CoDel: overloaded when the minimum queue delay of the last interval exceeded target.

    While overloaded, a waiter older than ``slough = factor × target`` is shed
    (folly: works better than dropping ever more often).
    """

    __slots__ = ("interval", "target", "slough_factor", "overloaded", "_min_delay", "_interval_end", "_reset")

    def __init__(self, interval: float, target: float, slough_factor: float, now: float) -> None:
        self.interval = interval
        self.target = target
        self.slough_factor = slough_factor
        self.overloaded = False
        self._min_delay = 0.0
        self._interval_end = now + interval
        self._reset = True

    @property
    def slough(self) -> float:
        return self.slough_factor * self.target

    def observe(self, now: float, delay: float) -> bool:
        """Record a dequeue after ``delay`` seconds in queue; True = shed it."""
        if now > self._interval_end and not self._reset:
            self.overloaded = self._min_delay > self.target
            self._reset = True
            self._interval_end = now + self.interval
        if self._reset:
            self._min_delay = delay
            self._reset = False
        elif delay < self._min_delay:
            self._min_delay = delay
        return self.overloaded and delay > self.slough

    def load(self) -> float:
        """folly getLoad(): 0..100, min delay relative to slough."""
        return min(100.0, 100.0 * self._min_delay / self.slough) if self.slough > 0 else 0.0


class _Rate:
    """Exponentially smoothed event rate (events per second)."""

    __slots__ = ("tau", "value", "_t")

    def __init__(self, tau: float, now: float) -> None:
        self.tau = tau
        self.value = 0.0
        self._t = now

    def _decay(self, now: float) -> None:
        if now > self._t:
            self.value *= math.exp(-(now - self._t) / self.tau)
            self._t = now

    def add(self, now: float, n: float = 1.0) -> None:
        self._decay(now)
        self.value += n / self.tau

    def get(self, now: float) -> float:
        self._decay(now)
        return self.value


class PushedLimits:
    """What the supervisor pushed: an epoch, a rate quota (token bucket) and a leased ceiling.

    ``concurrency`` is the lease ceiling (None: none), valid until
    ``lease_expiry``; afterwards ``safe_concurrency`` (default: the last
    ceiling) applies, never "unlimited".  The same epoch again renews the
    lease.  ``rate`` None/0 = no quota; ``burst`` None = ``burst_fraction`` of rate.
    """

    __slots__ = ("burst_fraction", "epoch", "bucket", "_ceiling", "_lease_expiry", "_safe")

    def __init__(self, burst_fraction: float, now: float) -> None:
        self.burst_fraction = burst_fraction
        self.epoch = 0
        self.bucket = TokenBucket(0.0, 1.0, now)
        self._ceiling: int | None = None
        self._lease_expiry: float | None = None
        self._safe: int | None = None

    def set(self, now: float, epoch: int, *, rate: float | None = None, burst: float | None = None,
            concurrency: int | None = None, lease_expiry: float | None = None,
            safe_concurrency: int | None = None) -> bool:
        """Apply; False (ignored) if ``epoch`` is older than the current one."""
        if epoch < self.epoch:
            return False
        self.epoch = epoch
        r = float(rate or 0.0)
        b = burst if burst is not None else max(1.0, self.burst_fraction * r)
        self.bucket.set(now, r, b)
        self._ceiling = None if concurrency is None else max(0, int(concurrency))
        self._lease_expiry = lease_expiry
        self._safe = safe_concurrency
        return True

    def lease_expired(self, now: float) -> bool:
        return self._lease_expiry is not None and now > self._lease_expiry

    def uncapped(self) -> bool:
        """No ceiling now or after the lease (``ceiling`` is None at any time)."""
        return self._ceiling is None and self._safe is None

    def ceiling(self, now: float) -> int | None:
        """The lease ceiling in force at ``now`` (the safe value once the lease expired)."""
        if self.lease_expired(now):
            return self._safe if self._safe is not None else self._ceiling
        return self._ceiling


# --- decisions ----------------------------------------------------------------------------


_ids = itertools.count(1)


@dataclass(slots=True, eq=False)
class Permit:
    """An admitted request.  Set ``outcome`` before releasing if the handler knows it."""

    granted_at: float
    inflight_at_start: int
    enqueued_at: float
    deadline: float | None = None
    outcome: Outcome = "ok"
    released: bool = False
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def queue_s(self) -> float:
        return self.granted_at - self.enqueued_at


@dataclass(slots=True, eq=False)
class Ticket:
    """A queued request; ``expires_at`` is when it leaves the queue unserved."""

    enqueued_at: float
    deadline: float | None
    expires_at: float
    expiry_status: int  # 503 (max wait) or 504 (deadline)
    id: int = field(default_factory=lambda: next(_ids))


@dataclass(frozen=True, slots=True)
class Admit:
    permit: Permit


@dataclass(frozen=True, slots=True)
class Queued:
    ticket: Ticket


@dataclass(frozen=True, slots=True)
class Reject:
    """An answer without service.  ``retry_after`` in whole seconds (None for 504)."""

    status: int           # 429, 503, 504
    retry_after: int | None
    reason: str           # quota, queue_full, codel, max_wait, deadline, limit_zero


@dataclass(frozen=True, slots=True)
class Grant:
    ticket: Ticket
    permit: Permit


@dataclass(frozen=True, slots=True)
class Shed:
    ticket: Ticket
    reject: Reject


Decision = Union[Grant, Shed]


class GateStats(msgspec.Struct, kw_only=True):
    """Counters (cumulative) and current state, for the worker's Stats message."""

    epoch: int
    limit: int
    l1_limit: float | None
    ceiling: int | None
    lease_expired: bool
    rate: float
    burst: float
    inflight: int
    queued: int
    max_inflight: int               # since the previous snapshot(reset_max=True)
    admitted: int
    admitted_immediately: int
    completed: int
    ok: int
    status_400: int
    status_429: int
    status_500: int
    status_503: int
    status_504: int                 # deadline at admission/dequeue + handler timeouts ("dropped")
    shed: dict[str, int]            # answers without service by reason: quota, queue_full,
                                    # codel, max_wait, deadline, limit_zero
    codel_overloaded: bool
    codel_target_s: float
    baseline_s: float | None
    throughput: float               # completions per second (smoothed)
    probing: bool


# --- the machine -----------------------------------------------------------------------------


class AdmissionMachine:
    """The pure L0 gate; see the module docstring for the order of checks."""

    def __init__(self, settings: AdmissionSettings, now: float, controller: GradientController | None = None,
                 rng: random.Random | None = None) -> None:
        self.s = settings
        self.controller = controller
        self._rng = rng or random.Random()
        self.pushed = PushedLimits(settings.burst_fraction, now)
        self._bucket = self.pushed.bucket
        self._codel = CoDel(settings.codel_interval_s, settings.codel_target_min_s, settings.slough_factor, now)
        self._throughput = _Rate(settings.throughput_tau_s, now)
        self._queue: deque[Ticket] = deque()
        self._live: set[int] = set()
        self.inflight = 0
        self._max_inflight = 0
        self._external_baseline: float | None = None
        self._bl_start = now
        self._bl_samples: list[float] = []
        self._bl_p50s: deque[float] = deque(maxlen=max(1, settings.baseline_windows))
        self._now = now
        c: dict[str, int] = dict.fromkeys(
            ("admitted", "admitted_immediately", "completed", "ok", "400", "429", "500", "503", "504"), 0)
        self._c = c
        self._shed: dict[str, int] = {}

    # --- limits ------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.pushed.epoch

    def set_limits(self, now: float, epoch: int, *, rate: float | None = None, burst: float | None = None,
                   concurrency: int | None = None, lease_expiry: float | None = None,
                   safe_concurrency: int | None = None) -> bool:
        """Apply the supervisor's settings (``PushedLimits.set``); False if ``epoch`` is stale."""
        return self.pushed.set(now, epoch, rate=rate, burst=burst, concurrency=concurrency,
                               lease_expiry=lease_expiry, safe_concurrency=safe_concurrency)

    def set_baseline(self, service_p50_s: float | None) -> None:
        """Baseline service time for the CoDel target when there is no L1 controller."""
        self._external_baseline = service_p50_s

    def baseline_s(self) -> float | None:
        """Unloaded service p50: from the L1 probe, else the given one, else min of window p50s."""
        c = self.controller
        if c is not None and c.baseline_p50_s is not None:
            return c.baseline_p50_s
        if self._external_baseline is not None:
            return self._external_baseline
        return min(self._bl_p50s) if self._bl_p50s else None

    def ceiling(self, now: float) -> int | None:
        """The lease ceiling in force at ``now`` (the safe value once the lease expired)."""
        return self.pushed.ceiling(now)

    def limit(self, now: float) -> int:
        """In-flight limit = min(L1 limit, lease ceiling); a huge number if neither exists."""
        lim: float = math.inf
        if self.controller is not None:
            lim = self.controller.limit
        elif self.s.static_limit > 0:
            lim = float(self.s.static_limit)
        ceil = self.ceiling(now)
        if ceil is not None:
            lim = min(lim, float(ceil))
        return 1 << 30 if math.isinf(lim) else max(0, int(lim))

    def _queue_bound(self, now: float) -> int:
        lim: float
        if self.controller is not None:
            lim = max(self.controller.nominal_limit, self.controller.limit)
            ceil = self.ceiling(now)
            if ceil is not None:
                lim = min(lim, float(ceil))
        else:
            lim = float(min(self.limit(now), self.s.queue_max))
        return min(self.s.queue_max, math.ceil(self.s.queue_factor * lim))

    def target_s(self) -> float:
        base = self.baseline_s()
        t = self.s.codel_target_min_s if base is None else self.s.codel_target_fraction * base
        return min(max(t, self.s.codel_target_min_s), self.s.codel_target_max_s)

    # --- per request ----------------------------------------------------------------------------

    def try_admit(self, now: float, deadline: float | None = None) -> Admit | Queued | Reject:
        """Decide at once: admitted, queued, or rejected (never waits to reject).

        After ``Queued`` call ``poll(now)``: a waiter may be grantable at once
        (e.g. the limit just rose while others were queued).
        """
        self._advance(now)
        if deadline is not None and now >= deadline:
            return self._reject(504, "deadline")
        if not self._bucket.try_take(now):
            wait = self._bucket.wait_time(now)
            return self._reject(429, "quota", retry_after=self._clamp_retry(math.ceil(wait)))
        limit = self.limit(now)
        if self.inflight < limit and not self._queue:
            self._codel.observe(now, 0.0)
            self._c["admitted_immediately"] += 1
            return Admit(self._grant_permit(now, now, deadline))
        if limit <= 0:
            return self._reject(503, "limit_zero", retry_after=self._overload_retry(now))
        if len(self._queue) >= self._queue_bound(now):
            return self._reject(503, "queue_full", retry_after=self._overload_retry(now))
        target = self.target_s()
        expires, status = math.inf, 503
        if self.s.max_wait_factor > 0:
            expires = now + self.s.max_wait_factor * target
        if deadline is not None:
            base = self.baseline_s() or 0.0
            if deadline - base < expires:
                expires, status = max(now, deadline - base), 504
        ticket = Ticket(enqueued_at=now, deadline=deadline, expires_at=expires, expiry_status=status)
        self._queue.append(ticket)
        self._live.add(ticket.id)
        return Queued(ticket)

    def on_dequeue_check(self, now: float, enqueued_at: float, deadline: float | None = None) -> Reject | None:
        """Whether a waiter leaving the queue now may run (None) or is shed (Reject).

        Feeds CoDel with its queue delay.
        """
        if deadline is not None and now >= deadline:
            self._codel.observe(now, now - enqueued_at)
            return self._reject(504, "deadline")
        if self._codel.observe(now, now - enqueued_at):
            return self._reject(503, "codel", retry_after=self._overload_retry(now))
        return None

    def release(self, now: float, permit: Permit, outcome: Outcome | None = None) -> list[Decision]:
        """A request finished: free its permit, feed L1, serve waiters.  Returns grants/sheds."""
        if permit.released:
            return []
        permit.released = True
        out = outcome or permit.outcome
        self.inflight = max(0, self.inflight - 1)
        service = max(0.0, now - permit.granted_at)
        self._c["completed"] += 1
        key = {"ok": "ok", "dropped": "504", "ignored": "500", "bad_request": "400"}[out]
        self._c[key] += 1
        self._throughput.add(now)
        if out == "ok":
            self._baseline_sample(now, service)
        if self.controller is not None:
            self.controller.on_sample(now, service, permit.inflight_at_start, _L1_OUTCOME[out],
                                      started_at=permit.granted_at)
        return self.poll(now)

    def cancel(self, now: float, ticket: Ticket) -> bool:
        """The waiter went away (client closed, task cancelled); True if it was still queued."""
        if ticket.id not in self._live:
            return False
        self._live.discard(ticket.id)
        try:
            self._queue.remove(ticket)
        except ValueError:
            pass
        return True

    def expire(self, now: float, ticket: Ticket) -> Reject | None:
        """The waiter's own timer fired: shed it (None if it was already granted or shed)."""
        if not self.cancel(now, ticket):
            return None
        if ticket.expiry_status == 504:
            return self._reject(504, "deadline")
        return self._reject(503, "max_wait", retry_after=self._overload_retry(now))

    def poll(self, now: float) -> list[Decision]:
        """Time passes: update L1, shed expired waiters, grant free permits.  Call on a timer too."""
        self._advance(now)
        out: list[Decision] = []
        if self._queue:
            # Expire waiters whose time is up (the queue is short: bounded by the limit).
            expired = [t for t in self._queue if t.expires_at <= now]
            for t in expired:
                rej = self.expire(now, t)
                if rej is not None:
                    out.append(Shed(t, rej))
        while self._queue and self.inflight < self.limit(now):
            lifo = self.s.lifo_when_overloaded and self._codel.overloaded
            t = self._queue.pop() if lifo else self._queue.popleft()
            self._live.discard(t.id)
            rej = self.on_dequeue_check(now, t.enqueued_at, t.deadline)
            if rej is not None:
                out.append(Shed(t, rej))
                continue
            out.append(Grant(t, self._grant_permit(now, t.enqueued_at, t.deadline)))
        return out

    def next_expiry(self) -> float | None:
        """Earliest time a waiter expires (for a wrapper's timer)."""
        return min((t.expires_at for t in self._queue), default=None)

    # --- stats -------------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def codel(self) -> CoDel:
        return self._codel

    def snapshot(self, now: float, *, reset_max: bool = False) -> GateStats:
        c = self._c
        ctl = self.controller
        ceil = self.ceiling(now)
        st = GateStats(
            epoch=self.epoch, limit=self.limit(now), l1_limit=None if ctl is None else ctl.limit,
            ceiling=ceil, lease_expired=self.pushed.lease_expired(now),
            rate=self._bucket.rate, burst=self._bucket.burst, inflight=self.inflight, queued=len(self._queue),
            max_inflight=self._max_inflight, admitted=c["admitted"], admitted_immediately=c["admitted_immediately"],
            completed=c["completed"], ok=c["ok"], status_400=c["400"], status_429=c["429"], status_500=c["500"],
            status_503=c["503"], status_504=c["504"], shed=dict(self._shed),
            codel_overloaded=self._codel.overloaded, codel_target_s=self._codel.target,
            baseline_s=self.baseline_s(), throughput=self._throughput.get(now),
            probing=bool(ctl and ctl.probing),
        )
        if reset_max:
            self._max_inflight = self.inflight
        return st

    # --- internals ------------------------------------------------------------------------------------

    def _advance(self, now: float) -> None:
        self._now = now
        self._codel.target = self.target_s()
        if self.controller is not None:
            self.controller.update(now, overloaded=self._codel.overloaded)

    def _grant_permit(self, now: float, enqueued_at: float, deadline: float | None) -> Permit:
        self.inflight += 1
        if self.inflight > self._max_inflight:
            self._max_inflight = self.inflight
        self._c["admitted"] += 1
        return Permit(granted_at=now, inflight_at_start=self.inflight, enqueued_at=enqueued_at, deadline=deadline)

    def _reject(self, status: int, reason: str, retry_after: int | None = None) -> Reject:
        self._c[str(status)] += 1
        self._shed[reason] = self._shed.get(reason, 0) + 1
        return Reject(status, retry_after, reason)

    def _clamp_retry(self, seconds: float) -> int:
        return int(min(max(seconds, self.s.retry_after_min_s), self.s.retry_after_max_s))

    def _overload_retry(self, now: float) -> int:
        tput = self._throughput.get(now)
        drain = len(self._queue) / tput if tput > 0 else float(self.s.retry_after_max_s)
        return self._clamp_retry(math.ceil(drain + self._rng.random()))

    def _baseline_sample(self, now: float, service: float) -> None:
        if self.controller is not None and self.controller.baseline_p50_s is not None:
            return
        self._bl_samples.append(service)
        if now - self._bl_start >= self.s.baseline_window_s:
            if len(self._bl_samples) >= 10:
                self._bl_p50s.append(quantile(sorted(self._bl_samples), 0.5))
            self._bl_samples = []
            self._bl_start = now


# --- asyncio wrapper -------------------------------------------------------------------------------------


class Rejected(Exception):
    """Raised by ``AdmissionGate.admit`` instead of running the request."""

    def __init__(self, reject: Reject) -> None:
        super().__init__(f"{reject.status} {reject.reason}")
        self.status = reject.status
        self.retry_after = reject.retry_after
        self.reason = reject.reason

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [] if self.retry_after is None else [(b"retry-after", str(self.retry_after).encode())]


class AdmissionGate:
    """asyncio face of ``AdmissionMachine``: ``async with gate.admit(deadline) as permit: ...``.

    Raises ``Rejected`` (status, retry_after) without waiting when the machine
    rejects; waits on a future when queued.  Exceptions in the body set the
    outcome: ``TimeoutError`` and cancellation → "dropped" (504), anything
    else → "ignored" (500); or set ``permit.outcome`` yourself.
    Single event loop, no locks: every machine call happens on the loop.
    """

    def __init__(self, machine: AdmissionMachine, clock: Callable[[], float] = time.monotonic) -> None:
        self.machine = machine
        self.clock = clock
        self._waiters: dict[int, asyncio.Future[Permit]] = {}

    def _dispatch(self, decisions: list[Decision]) -> None:
        for d in decisions:
            fut = self._waiters.pop(d.ticket.id, None)
            if fut is None or fut.done():
                if isinstance(d, Grant):  # nobody is waiting for it any more: give it back
                    self._dispatch(self.machine.release(self.clock(), d.permit, "ignored"))
                continue
            if isinstance(d, Grant):
                fut.set_result(d.permit)
            else:
                fut.set_exception(Rejected(d.reject))

    def set_limits(self, epoch: int, **kw: Any) -> bool:
        """``AdmissionMachine.set_limits`` + wake waiters the new limit lets in."""
        now = self.clock()
        ok = self.machine.set_limits(now, epoch, **kw)
        self._dispatch(self.machine.poll(now))
        return ok

    def tick(self) -> None:
        """Call from a periodic task (e.g. every 50 ms): L1 windows, expiries, grants."""
        self._dispatch(self.machine.poll(self.clock()))

    async def acquire(self, deadline: float | None = None) -> Permit:
        now = self.clock()
        d = self.machine.try_admit(now, deadline)
        if isinstance(d, Reject):
            raise Rejected(d)
        if isinstance(d, Admit):
            return d.permit
        ticket = d.ticket
        fut: asyncio.Future[Permit] = asyncio.get_running_loop().create_future()
        self._waiters[ticket.id] = fut
        self._dispatch(self.machine.poll(now))
        timeout = None if math.isinf(ticket.expires_at) else max(0.0, ticket.expires_at - now)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            if fut.done():
                return fut.result()
            self._waiters.pop(ticket.id, None)
            rej = self.machine.expire(self.clock(), ticket)
            raise Rejected(rej or Reject(503, "max_wait", self.machine.s.retry_after_min_s)) from None
        except asyncio.CancelledError:
            self._waiters.pop(ticket.id, None)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result(), "ignored")
            else:
                self.machine.cancel(self.clock(), ticket)
            raise

    def release(self, permit: Permit, outcome: Outcome | None = None) -> None:
        self._dispatch(self.machine.release(self.clock(), permit, outcome))

    def admit(self, deadline: float | None = None) -> "_Admission":
        return _Admission(self, deadline)


class _Admission:
    __slots__ = ("gate", "deadline", "permit")

    def __init__(self, gate: AdmissionGate, deadline: float | None) -> None:
        self.gate = gate
        self.deadline = deadline
        self.permit: Permit | None = None

    async def __aenter__(self) -> Permit:
        self.permit = await self.gate.acquire(self.deadline)
        return self.permit

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        permit = self.permit
        if permit is None:
            return
        outcome: Outcome = permit.outcome
        if exc_type is not None:
            if issubclass(exc_type, (TimeoutError, asyncio.TimeoutError, asyncio.CancelledError)):
                outcome = "dropped"
            else:
                outcome = "ignored"
        self.gate.release(permit, outcome)


def make_gate(settings: AdmissionSettings, gradient: "GradientSettings | None",
              clock: Callable[[], float] = time.monotonic) -> "AdmissionGate":
    """The asyncio gate of limiters "gradient"/"static" (with its controller when gradient)."""
    now = clock()
    controller = GradientController(gradient, now) if gradient is not None else None
    return AdmissionGate(AdmissionMachine(settings, now, controller), clock)
