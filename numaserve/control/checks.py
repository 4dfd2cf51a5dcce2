"""Value checks on worker messages that the msgspec types cannot express.

The schema says ``Stats.extra`` is a map of anything; the supervisor's
limits, metrics and totals read a few keys of it as numbers.  A message
whose numbers are not finite, negative, of the wrong type or absurdly long
is refused here (counted and dropped by the caller), so nothing downstream
can raise on it.  Pure.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["finite", "heartbeat_problem", "stats_problem"]

MAX_BUCKETS = 512
_COUNT_KEYS = ("latency_count", "connections_local", "connections_remote", "connections_unknown",
               "accept_errors", "fd_limit_hits", "fds_open", "fd_limit")
_GATE_COUNTS = ("admitted", "ok", "epoch", "queued", "inflight")


def finite(v: Any) -> bool:
    """A real number (not bool) that is neither NaN nor infinite."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def stats_problem(msg: Any) -> str | None:
    """Why a Stats message cannot be used, or None."""
    for name in ("requests", "inflight", "queued", "shed", "connections", "rss_bytes", "limits_epoch"):
        if not _count(getattr(msg, name, 0)):
            return f"{name} = {getattr(msg, name, None)!r}: expected a count"
    for k, v in msg.status_classes.items():
        if not _count(v):
            return f"status_classes[{k!r}] = {v!r}: expected a count"
    for k, v in msg.latency_ms.items():
        if not finite(v):
            return f"latency_ms[{k!r}] = {v!r}: expected a finite number"
    extra = msg.extra
    buckets = extra.get("latency_buckets")
    if buckets is not None:
        if not isinstance(buckets, list) or len(buckets) > MAX_BUCKETS or not all(_count(b) for b in buckets):
            return f"extra.latency_buckets: expected at most {MAX_BUCKETS} counts"
    for k in _COUNT_KEYS:
        if k in extra and not _count(extra[k]):
            return f"extra.{k} = {extra[k]!r}: expected a count"
    if "latency_sum_ms" in extra and not (finite(extra["latency_sum_ms"]) and extra["latency_sum_ms"] >= 0):
        return f"extra.latency_sum_ms = {extra['latency_sum_ms']!r}: expected a finite number >= 0"
    gate = extra.get("admission")
    if gate is not None:
        if not isinstance(gate, dict):
            return "extra.admission: expected a map"
        for k in _GATE_COUNTS:
            if k in gate and not _count(gate[k]):
                return f"extra.admission.{k} = {gate[k]!r}: expected a count"
        shed = gate.get("shed")
        if shed is not None and not (isinstance(shed, dict) and all(_count(v) for v in shed.values())):
            return "extra.admission.shed: expected a map of counts"
        for k in ("limit", "l1_limit"):
            if gate.get(k) is not None and not finite(gate[k]):
                return f"extra.admission.{k} = {gate[k]!r}: expected a finite number"
    return None


def heartbeat_problem(msg: Any) -> str | None:
    if not (finite(msg.loop_lag) and msg.loop_lag >= 0):
        return f"loop_lag = {msg.loop_lag!r}: expected a finite number >= 0"
    if not finite(msg.mono):
        return f"mono = {msg.mono!r}: expected a finite number"
    return None
