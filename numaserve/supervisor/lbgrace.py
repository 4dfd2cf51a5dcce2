"""Load-balancer-safe stopping: how long to keep serving with ``/readyz`` at 503.

A balancer (HAProxy, nginx, a cloud LB, Kubernetes endpoints) takes a host
out only after its health checks see ``/readyz`` fail, a few check intervals
later.  Closing before that resets the connections it still sends.  So a
graceful stop turns readiness off at once, waits ``server.lb_grace``, and only
then drains.

The wait only helps when something watches readiness: a host nobody probes
(a single machine, a developer's run) would just stop ``lb_grace`` slower.
``ProbeClock`` remembers when ``/readyz`` was last asked, and
``decide_lb_grace`` spends the grace only when that was recently enough for a
balancer that notices within ``lb_grace`` (it must probe more often than that).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

__all__ = ["WATCH_WINDOW_MIN_S", "GraceDecision", "ProbeClock", "decide_lb_grace", "watch_window"]

#: A /readyz request less than this long ago means a balancer is watching
#: (any sane health-check interval, Kubernetes' default period of 10 s included).
WATCH_WINDOW_MIN_S = 60.0


class ProbeClock:
    """Monotonic time of the last ``/readyz`` request (``seen()`` per request)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.last: float | None = None
        self.count = 0

    def seen(self) -> None:
        self.last = self._clock()
        self.count += 1

    def age(self) -> float | None:
        """Seconds since the last probe; None when there never was one."""
        return None if self.last is None else max(0.0, self._clock() - self.last)


@dataclass(frozen=True)
class GraceDecision:
    seconds: float
    reason: str


def watch_window(lb_grace: float) -> float:
    """How recent a probe must be to count as "watched": a balancer that notices
    within ``lb_grace`` probes at least every ``lb_grace``; three of them, and
    never less than a minute."""
    return max(WATCH_WINDOW_MIN_S, 3.0 * lb_grace)


def decide_lb_grace(lb_grace: float, probe_age: float | None) -> GraceDecision:
    """The grace to spend on this stop, with the reason (logged at stop)."""
    if lb_grace <= 0:
        return GraceDecision(0.0, "server.lb_grace = 0")
    window = watch_window(lb_grace)
    if probe_age is None:
        return GraceDecision(0.0, "/readyz was never requested: no balancer is watching")
    if probe_age > window:
        return GraceDecision(0.0, f"/readyz last requested {probe_age:.0f}s ago (> {window:g}s): "
                                  "no balancer is watching")
    return GraceDecision(lb_grace, f"/readyz requested {probe_age:.1f}s ago: waiting for balancers")
