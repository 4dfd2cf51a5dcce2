"""Request counters and a fixed-bucket latency histogram for ``Stats`` messages.

Buckets are fixed and log-scaled (4 per doubling, 10 µs .. ~141 s, then overflow) so every
worker's counts line up bucket for bucket: the supervisor merges workers by
adding the cumulative counts carried in ``extra["latency_buckets"]`` (layout
named by ``extra["latency_bucket_schema"]``, bounds in ``BUCKET_UPPER_MS``),
which is exact, instead of averaging percentiles, which is wrong.  Percentiles for the
message itself come from a sliding window of recent intervals so they follow
the load instead of the whole uptime.
"""

from __future__ import annotations

import bisect
import math
import os
from typing import Any

__all__ = [
    "BUCKET_SCHEMA",
    "BUCKET_UPPER_MS",
    "LatencyHistogram",
    "StatsDedup",
    "WindowedHistogram",
    "WorkerStats",
    "bucket_index",
    "read_rss_bytes",
    "status_class",
]

_BASE_MS = 0.01
_PER_DOUBLING = 4
_N_BUCKETS = 96  # 0.01 ms * 2**(95/4) ~= 141 s; one overflow bucket above that

#: Names the bucket layout in ``extra``; bump it if the layout ever changes.
BUCKET_SCHEMA = f"log2/{_PER_DOUBLING}:{_BASE_MS}ms:{_N_BUCKETS + 1}"

#: Upper bound (inclusive, ms) of each bucket; the last bucket is +inf (overflow).
BUCKET_UPPER_MS: tuple[float, ...] = tuple(
    [_BASE_MS * 2 ** (i / _PER_DOUBLING) for i in range(_N_BUCKETS)] + [math.inf]
)


def bucket_index(ms: float) -> int:
    """Index of the first bucket whose upper bound is >= ``ms``."""
    return bisect.bisect_left(BUCKET_UPPER_MS, ms)


class LatencyHistogram:
    """Counts per fixed bucket plus exact count, sum and max."""

    __slots__ = ("counts", "count", "sum_ms", "max_ms")

    def __init__(self) -> None:
        self.counts: list[int] = [0] * len(BUCKET_UPPER_MS)
        self.count = 0
        self.sum_ms = 0.0
        self.max_ms = 0.0

    def observe(self, ms: float) -> None:
        ms = max(0.0, ms)
        self.counts[bucket_index(ms)] += 1
        self.count += 1
        self.sum_ms += ms
        if ms > self.max_ms:
            self.max_ms = ms

    def merge(self, other: "LatencyHistogram") -> None:
        for i, c in enumerate(other.counts):
            if c:
                self.counts[i] += c
        self.count += other.count
        self.sum_ms += other.sum_ms
        self.max_ms = max(self.max_ms, other.max_ms)

    def clear(self) -> None:
        self.counts = [0] * len(BUCKET_UPPER_MS)
        self.count = 0
        self.sum_ms = 0.0
        self.max_ms = 0.0

    def percentile(self, q: float) -> float:
        """Estimate the q-quantile (0..1) by linear interpolation inside its bucket.

        Error is bounded by the bucket width (~19 %); the result never exceeds
        the observed maximum.
        """
        if self.count == 0:
            return 0.0
        rank = q * self.count
        cum = 0
        for i, c in enumerate(self.counts):
            if not c:
                continue
            if cum + c >= rank:
                lo = BUCKET_UPPER_MS[i - 1] if i > 0 else 0.0
                hi = BUCKET_UPPER_MS[i]
                if math.isinf(hi):
                    return self.max_ms
                frac = (rank - cum) / c
                return min(lo + (hi - lo) * frac, self.max_ms)
            cum += c
        return self.max_ms

    def summary(self) -> dict[str, float]:
        """The ``latency_ms`` dict of a Stats message (all zero when empty)."""
        mean = self.sum_ms / self.count if self.count else 0.0
        return {
            "p50": round(self.percentile(0.50), 3),
            "p90": round(self.percentile(0.90), 3),
            "p99": round(self.percentile(0.99), 3),
            "mean": round(mean, 3),
            "max": round(self.max_ms, 3),
        }


class WindowedHistogram:
    """A ring of ``slots`` histograms; ``rotate()`` once per stats interval.

    The window therefore covers the last ``slots`` intervals (the current one
    included), so a quiet interval does not zero the percentiles.
    """

    def __init__(self, slots: int) -> None:
        self._ring = [LatencyHistogram() for _ in range(max(1, slots))]
        self._cur = 0
        #: the slot being filled now: a plain attribute (not a property), since the worker
        #: reads it once per request
        self.current = self._ring[0]

    def observe(self, ms: float) -> None:
        self.current.observe(ms)

    def merged(self) -> LatencyHistogram:
        out = LatencyHistogram()
        for h in self._ring:
            out.merge(h)
        return out

    def rotate(self) -> None:
        self._cur = (self._cur + 1) % len(self._ring)
        self.current = self._ring[self._cur]
        self.current.clear()


def status_class(status: int) -> str:
    """"2xx" style class of an HTTP status (anything odd is "other")."""
    if 100 <= status <= 599:
        return f"{status // 100}xx"
    return "other"


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def read_rss_bytes(path: str = "/proc/self/statm") -> int:
    """Resident set size from statm (2nd field, pages); 0 if unreadable.

    statm is one short read with no parsing of units, cheap enough to do on
    every stats tick.
    """
    try:
        with open(path, "rb") as f:
            fields = f.read().split()
        return int(fields[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class WorkerStats:
    """Everything the worker reports, updated by the edge (``numaserve.worker.edge``).

    The per-request update is a few attribute and list increments: the
    status is counted by its number (classes are formed per report), the
    latency goes into the current window slot only (one bucket lookup), and
    that slot is folded into the cumulative histogram when the window
    rotates, once per stats interval.
    """

    def __init__(self, window_slots: int = 10) -> None:
        self.requests = 0          # completed (any outcome)
        self.inflight = 0
        self.by_status: dict[int, int] = {}
        self.window = WindowedHistogram(window_slots)
        self._folded = LatencyHistogram()   # cumulative, up to the last rotation
        self.draining = False
        self.rejected_body_too_large = 0
        self.rejected_read_timeout = 0
        self.conn_local = 0          # accepted on a CPU of this worker's node
        self.conn_remote = 0
        self.conn_unknown = 0

    def connection_accepted(self, local: bool | None) -> None:
        if local is None:
            self.conn_unknown += 1
        elif local:
            self.conn_local += 1
        else:
            self.conn_remote += 1

    def request_started(self) -> None:
        self.inflight += 1

    def request_finished(self, status: int, latency_ms: float) -> None:
        self.inflight -= 1
        self.requests += 1
        by = self.by_status
        by[status] = by.get(status, 0) + 1
        h = self.window.current
        if latency_ms < 0.0:
            latency_ms = 0.0
        h.counts[bisect.bisect_left(BUCKET_UPPER_MS, latency_ms)] += 1
        h.count += 1
        h.sum_ms += latency_ms
        if latency_ms > h.max_ms:
            h.max_ms = latency_ms

    @property
    def status_classes(self) -> dict[str, int]:
        """Completed requests by status class ("2xx" ...)."""
        out: dict[str, int] = {}
        for status, n in self.by_status.items():
            cls = status_class(status)
            out[cls] = out.get(cls, 0) + n
        return out

    @property
    def cumulative(self) -> LatencyHistogram:
        """Every latency since start (a copy: folded intervals plus the current one)."""
        out = LatencyHistogram()
        out.merge(self._folded)
        out.merge(self.window.current)
        return out

    def snapshot(self, *, connections: int = 0, rss_bytes: int | None = None,
                 rotate: bool = True) -> dict[str, Any]:
        """Keyword arguments for ``Stats`` (minus slot/generation); rotates the window."""
        summary = self.window.merged().summary()
        cumulative = self.cumulative
        if rotate:
            self._folded.merge(self.window.current)
            self.window.rotate()
        return {
            "requests": self.requests,
            "inflight": self.inflight,
            "connections": connections,
            "status_classes": self.status_classes,
            "latency_ms": summary,
            "rss_bytes": read_rss_bytes() if rss_bytes is None else rss_bytes,
            "draining": self.draining,
            "extra": {
                "latency_buckets": list(cumulative.counts),
                "latency_bucket_schema": BUCKET_SCHEMA,
                "latency_count": cumulative.count,
                "latency_sum_ms": round(cumulative.sum_ms, 3),
                "rejected_body_too_large": self.rejected_body_too_large,
                "rejected_read_timeout": self.rejected_read_timeout,
                "connections_local": self.conn_local,
                "connections_remote": self.conn_remote,
                "connections_unknown": self.conn_unknown,
            },
        }


class StatsDedup:
    """Skip stats that did not change since the last ones sent (an idle worker's).

    The supervisor keeps the last stats it got, so unchanged ones carry nothing
    new; decoding them (a 97-bucket histogram and the extras) was most of the
    cost of an idle worker's beat.  Sent anyway every ``refresh`` calls, so a
    supervisor that missed one (a full queue drops messages) catches up.
    """

    def __init__(self, refresh: int = 10) -> None:
        self.refresh = max(1, refresh)
        self._last: bytes | None = None
        self._skipped = 0
        self.skipped_total = 0

    def due(self, encoded: bytes) -> bool:
        """Whether stats encoding to ``encoded`` should be sent now (and remember them if so)."""
        if encoded == self._last and self._skipped + 1 < self.refresh:
            self._skipped += 1
            self.skipped_total += 1
            return False
        self._last = encoded
        self._skipped = 0
        return True
