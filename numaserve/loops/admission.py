"""The ``[admission]`` settings of the worker's CPU gate and the pieces it shares with the supervisor's push.

One model (docs/admission.md): the in-loop CPU gate (``numaserve.loops.cpu_gate``)
refuses a request only when the loop is short of CPU and other requests already
wait for it; the worker's sentinel thread (``numaserve.worker.shedding``) answers
from the accept queue while a handler blocks the loop.  The supervisor pushes one
limit to the gate (``PushedLimits``: a lease ceiling and a rate quota; Vegas, the
SLO guard or an operator's ``numaserve ratelimit``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from numaserve.loops.checks import at_least, ordered, positive

__all__ = [
    "Admit",
    "AdmissionSettings",
    "Outcome",
    "PushedLimits",
    "Reject",
    "TokenBucket",
]

Outcome = Literal["ok", "dropped", "ignored", "bad_request"]

# Internal tuning of the gate (were [admission] keys; nobody had a reason to set them).
#: Weight of a new lag sample in the smoothed lag.
LAG_SMOOTHING = 0.5
#: Overloaded = the loop busy without an idle moment for BUSY_THRESHOLD of the recent past
#: (time constant BUSY_WINDOW_S), until that share falls below BUSY_RELEASE (no flapping).
BUSY_WINDOW_S = 0.5
BUSY_THRESHOLD = 0.95
BUSY_RELEASE = 0.8
#: Loop-lag probe period while the loop is busy, doubling up to PROBE_MAX_S while it is idle.
PROBE_MIN_S = 0.001
PROBE_MAX_S = 0.008
#: Token-bucket burst (share of the rate) when the supervisor pushes a rate without one.
BURST_FRACTION = 0.1
#: Retry-After of a refusal: the time to drain what waits, clamped to this range (whole seconds).
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 30
#: Smoothing of the completion rate that sizes Retry-After (s).
THROUGHPUT_TAU_S = 2.0


class AdmissionSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``[admission]`` section: the worker's CPU gate and its sentinel (docs/admission.md)."""

    enabled: bool = True                 # admission control in front of every worker's app
    request_timeout_s: float = 0.0       # deadline per request when the client sends none (0: none)
    lag_target_s: float = 0.010          # the loop is short of CPU while its smoothed lag is above this
    cpu_concurrency: int = 2             # overloaded: admit only if fewer requests than this wait for CPU ...
    overload_wait_s: float = 0.04        # ... or what they wait for is less CPU than this
    cpu_burst: int = 8                   # short of CPU in a burst (not overloaded): the same bound ...
    burst_wait_s: float = 0.1            # ... and all of them by their expected CPU (count × CPU per request)
    max_inflight: int = 0                # safety cap on requests in flight, streams included (0: none)
    sentinel: bool = True                # a thread answers 503 from the accept queue while the loop is stalled
    stall_after_s: float = 0.002         # stalled: the probe is this late (while short of CPU) ...
    stall_idle_after_s: float = 1.0      # ... or this late otherwise (a cold start, a GC pause: not overload)
    stall_queue: int = 1                 # connections left waiting in the accept queue during a stall (at least)
    close_when_overloaded: bool = False  # Connection: close on responses while shedding (clients come back
                                         # through the accept queue, where the sentinel sees them)
    overload_hold_s: float = 1.0         # "shedding" lasts this long after the last shed
    gone_check_after_s: float = 0.02     # a request that waited longer is checked for a departed client

    # The tuning constants, read where the settings are (``s.probe_min_s``): not keys.
    lag_smoothing = LAG_SMOOTHING
    busy_window_s = BUSY_WINDOW_S
    busy_threshold = BUSY_THRESHOLD
    busy_release = BUSY_RELEASE
    probe_min_s = PROBE_MIN_S
    probe_max_s = PROBE_MAX_S
    burst_fraction = BURST_FRACTION
    retry_after_min_s = RETRY_AFTER_MIN_S
    retry_after_max_s = RETRY_AFTER_MAX_S
    throughput_tau_s = THROUGHPUT_TAU_S

    def __post_init__(self) -> None:
        at_least(self, 0, "request_timeout_s", "max_inflight", "stall_queue", "overload_hold_s",
                 "gone_check_after_s")
        positive(self, "lag_target_s", "burst_wait_s", "overload_wait_s", "stall_after_s", "stall_idle_after_s")
        at_least(self, 1, "cpu_concurrency", "cpu_burst")
        ordered(self, "cpu_concurrency", "cpu_burst")
        ordered(self, "stall_after_s", "stall_idle_after_s")


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


@dataclass(frozen=True, slots=True)
class Admit:
    permit: Any   # numaserve.loops.cpu_gate.CpuPermit (that module imports this one)


@dataclass(frozen=True, slots=True)
class Reject:
    """An answer without service.  ``retry_after`` in whole seconds (None for 504)."""

    status: int           # 429, 503, 504
    retry_after: int | None
    reason: str           # one of numaserve.refusals.REFUSAL_REASONS (cpu, limit, quota, deadline)
