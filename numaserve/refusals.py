"""Why this 503: the one fixed set of reasons numaserve refuses a request for.

Every answer numaserve gives *instead of* the app because of load (503, 429,
504) names one reason from ``REFUSAL_REASONS``, the same word in three
places, so an operator can go from a client's error to the counter without
reading the code:

* the response header ``x-numaserve-refusal: <reason>`` (HTTP answers and
  the headers of frame error frames);
* the access log line (`` refusal=<reason>`` appended, whatever the format);
* the metric label ``numaserve_shed_requests_by_reason_total{reason}`` and
  ``numaserve status`` ("refused (since start)"), both read from the
  worker's gate counters, which are kept under these names.

=============  ======  ========================================================
reason         status  what refused it
=============  ======  ========================================================
``cpu``        503     the CPU gate: the worker's loop is short of CPU and
                       others already wait for it (``loops/cpu_gate.py``)
``stalled``    503     the sentinel thread: a handler blocks the loop, the
                       connection waited in the accept queue
``limit``      503     a concurrency ceiling: the supervisor's pushed limit
                       (SLO guard, ``ratelimit set N``, 0 included) or
                       ``admission.max_inflight``
``quota``      429     the supervisor's pushed rate (``ratelimit set R/s``,
                       Vegas)
``deadline``   504     the request's deadline (``x-request-timeout`` or
                       ``admission.request_timeout_s``) passed before its
                       response started
``connections`` 503    ``server.max_connections`` reached (uvicorn's
                       concurrency limit)
=============  ======  ========================================================

The gate's internal names of earlier releases (``stall``, ``inflight_cap``,
``limit_zero``) are mapped once, by ``public_reason``, for counters that
still carry them.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "REFUSAL_HEADER",
    "REFUSAL_REASONS",
    "REFUSAL_STATUS",
    "public_reason",
    "refusal_header",
    "refusal_of",
]

#: The response header naming the reason (lower case, as HTTP/1 headers are compared).
REFUSAL_HEADER = b"x-numaserve-refusal"

#: The fixed set, in the order ``numaserve status`` and the docs list them.
REFUSAL_REASONS: tuple[str, ...] = ("cpu", "stalled", "limit", "quota", "deadline", "connections")

#: The status each reason is answered with.
REFUSAL_STATUS: dict[str, int] = {
    "cpu": 503, "stalled": 503, "limit": 503, "quota": 429, "deadline": 504, "connections": 503,
}

#: Names the gate used before the set was fixed (kept readable in old counters).
_OLD_NAMES: dict[str, str] = {"stall": "stalled", "inflight_cap": "limit", "limit_zero": "limit"}

_HEADERS: dict[str, tuple[bytes, bytes]] = {r: (REFUSAL_HEADER, r.encode("ascii")) for r in REFUSAL_REASONS}


def public_reason(name: str) -> str:
    """The reason of the fixed set for ``name`` (itself, or an old internal name mapped)."""
    return _OLD_NAMES.get(name, name)


def refusal_header(reason: str) -> tuple[bytes, bytes]:
    """The ``x-numaserve-refusal`` header pair for ``reason``; ValueError for a name outside the set
    (a refusal path with a new reason must add it here, where the docs and tests see it)."""
    try:
        return _HEADERS[reason]
    except KeyError:
        raise ValueError(f"unknown refusal reason {reason!r}: expected one of "
                         + ", ".join(REFUSAL_REASONS)) from None


def refusal_of(headers: Iterable[tuple[bytes, bytes]] | None) -> str | None:
    """The refusal reason in response ``headers``, or None (not a refusal)."""
    for name, value in headers or ():
        if name == REFUSAL_HEADER or name.lower() == REFUSAL_HEADER:
            return value.decode("latin-1")
    return None
