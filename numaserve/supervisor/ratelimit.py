"""Per-peer token buckets for the ops channel.

One client looping on ``status`` (or many requests pipelined on a DEALER)
must not take the supervision loop's time: each peer gets ``rate`` requests
per second with bursts of ``burst``; past that it gets a short "rate limited"
reply instead of the work.  The table is bounded (least recently seen peers
are forgotten first; a forgotten peer starts with a full bucket, which is
what a long-idle peer would have anyway).  Pure: the clock is injected.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Hashable

__all__ = ["PeerRateLimiter"]


class PeerRateLimiter:
    def __init__(self, rate: float, burst: float, *, max_peers: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not rate > 0 or not burst >= 1:
            raise ValueError(f"rate {rate!r} must be > 0 and burst {burst!r} >= 1")
        self.rate = float(rate)
        self.burst = float(burst)
        self.max_peers = max_peers
        self.clock = clock
        self.limited = 0
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # peer -> (tokens, at)

    def allow(self, peer: Hashable) -> tuple[bool, float]:
        """Take one token for ``peer``: (allowed, seconds until the next token when refused)."""
        now = self.clock()
        tokens, at = self._buckets.pop(peer, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate)
        ok = tokens >= 1.0
        if ok:
            tokens -= 1.0
        else:
            self.limited += 1
        self._buckets[peer] = (tokens, now)
        while len(self._buckets) > self.max_peers:
            self._buckets.popitem(last=False)
        return ok, 0.0 if ok else (1.0 - tokens) / self.rate

    def __len__(self) -> int:
        return len(self._buckets)
