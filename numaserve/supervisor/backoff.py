"""Restart policy per slot: exponential backoff with jitter and a cap, reset
after a stable period, and crash-loop detection over a sliding window.

Pure: the caller passes the clock, so tests run on a virtual one.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    initial: float = 0.5
    maximum: float = 30.0
    jitter: float = 0.2          # ±fraction of the delay
    reset_after: float = 60.0    # a worker up this long resets the backoff
    loop_limit: int = 5          # this many crashes ...
    loop_window: float = 60.0    # ... within this many seconds = crash loop


@dataclass
class RestartState:
    policy: RestartPolicy
    consecutive: int = 0
    crashes: deque[float] = field(default_factory=deque)
    rng: random.Random = field(default_factory=random.Random)

    def record_exit(self, now: float, uptime: float, *, counted: bool = True) -> tuple[float, bool]:
        """Record a worker exit; return (delay before restart, crash_loop?).

        ``counted=False`` for exits we caused (stop, replace, hang kill counts).
        """
        if uptime >= self.policy.reset_after:
            self.consecutive = 0
        if not counted:
            return 0.0, False
        self.consecutive += 1
        self.crashes.append(now)
        while self.crashes and now - self.crashes[0] > self.policy.loop_window:
            self.crashes.popleft()
        looping = len(self.crashes) >= self.policy.loop_limit
        base = min(self.policy.maximum, self.policy.initial * (2 ** (self.consecutive - 1)))
        j = self.policy.jitter
        delay = base * (1.0 + self.rng.uniform(-j, j)) if j else base
        return min(delay, self.policy.maximum * (1 + j)), looping

    def reset(self) -> None:
        self.consecutive = 0
        self.crashes.clear()
