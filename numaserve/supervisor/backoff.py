"""Restart policy per slot: exponential backoff with jitter and a cap, reset
after a stable period, and crash-loop detection over a sliding window.

Only the slot's own failures count towards the crash loop (crashes, boot
failures, hangs).  Kills from outside while the worker served (the OOM
killer, an operator's ``kill -9``, a stray SIGTERM) are restarted at once and
never make a slot ``failed``; only a storm of them (more than ``loop_limit``
within ``loop_window``) is paced by the same exponential delay, so a worker
killed the moment it becomes ready does not spin.

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
    # ±fraction of the delay, fixed (not a config key): slots that crashed together do not restart in step
    jitter: float = 0.2
    reset_after: float = 60.0    # a worker up this long resets the backoff
    loop_limit: int = 5          # this many crashes ...
    loop_window: float = 60.0    # ... within this many seconds = crash loop
    failed_retry: float = 300.0  # a failed slot is tried again after this long


@dataclass
class RestartState:
    policy: RestartPolicy
    consecutive: int = 0
    crashes: deque[float] = field(default_factory=deque)
    external: deque[float] = field(default_factory=deque)
    rng: random.Random = field(default_factory=random.Random)

    def _jittered(self, base: float) -> float:
        j = self.policy.jitter
        delay = base * (1.0 + self.rng.uniform(-j, j)) if j else base
        return min(delay, self.policy.maximum * (1 + j))

    def record_exit(self, now: float, uptime: float, *, counted: bool = True,
                    external: bool = False) -> tuple[float, bool]:
        """Record a worker exit; return (delay before restart, crash_loop?).

        ``counted=False`` for exits we caused (stop, replace).  ``external``:
        killed from outside while serving: restarted without delay, never a
        crash loop (paced only when more than ``loop_limit`` come within
        ``loop_window``).
        """
        if uptime >= self.policy.reset_after:
            self.consecutive = 0
        if external:
            self.external.append(now)
            while self.external and now - self.external[0] > self.policy.loop_window:
                self.external.popleft()
            over = len(self.external) - self.policy.loop_limit
            if over <= 0:
                return 0.0, False
            return self._jittered(min(self.policy.maximum, self.policy.initial * (2 ** (over - 1)))), False
        if not counted:
            return 0.0, False
        self.consecutive += 1
        self.crashes.append(now)
        while self.crashes and now - self.crashes[0] > self.policy.loop_window:
            self.crashes.popleft()
        looping = len(self.crashes) >= self.policy.loop_limit
        base = min(self.policy.maximum, self.policy.initial * (2 ** (self.consecutive - 1)))
        return self._jittered(base), looping

    def retry_delay(self) -> float:
        """How long a failed slot waits before it is tried again (jittered)."""
        j = self.policy.jitter
        return self.policy.failed_retry * (1.0 + self.rng.uniform(-j, j)) if j else self.policy.failed_retry

    def reset(self) -> None:
        self.consecutive = 0
        self.crashes.clear()
        self.external.clear()
