"""The load engine: ``numaserve.tools.loadtest`` plus two views the bench needs.

``numaserve.tools.loadtest`` keeps one latency histogram for every response, whatever
its status, and no time line.  The overload scenario needs the latency of
200s and of 503s apart (p99 of admitted requests, shed latency) and the
reload/kill scenarios need completions over time.  Rather than fork the load
generator, ``run()`` swaps in a ``LoadResult`` subclass for the duration of
one run whose histogram and counters also file each response under its
status class and its completion time.  It relies on what ``_Run.request``
does on a response (record the latency, then count the status, with no await
in between) and checks the invariant afterwards, so a change there fails
loudly instead of silently mis-filing.  (A ``latency_by_status`` option in
``numaserve.tools.loadtest`` would make this unnecessary; see docs/benchmarks.md.)
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import numaserve.tools.loadtest as lt

#: Width of a time-line bucket, seconds.
BIN_S = 0.1
#: A response slower than this is also put on the time line as "slow" (delayed requests).
SLOW_S = 1.0

_patch_lock = threading.Lock()


class _SplitRecorder(lt.LatencyRecorder):
    """The run's histogram; remembers the last value so the status can file it."""

    def __init__(self, owner: "_Split") -> None:
        super().__init__()
        self._owner = owner

    def record(self, seconds: float) -> None:
        super().record(seconds)
        self._owner.pending = seconds


class _StatusCounts(dict):  # type: ignore[type-arg]
    """``status_counts`` that files the pending latency under the status set."""

    def __init__(self, owner: "_Split") -> None:
        super().__init__()
        self._owner = owner

    def __setitem__(self, status: int, count: int) -> None:
        super().__setitem__(status, count)
        self._owner.file(status)


class _Errors(dict):  # type: ignore[type-arg]
    """``errors`` that also puts each failure on the time line."""

    def __init__(self, owner: "_Split", init: dict[str, int]) -> None:
        super().__init__(init)
        self._owner = owner

    def __setitem__(self, kind: str, count: int) -> None:
        if kind in self and count > self[kind]:
            self._owner.tick("error")
            self._owner.fresh.pop(asyncio.current_task(), None)
        super().__setitem__(kind, count)


def status_class(status: int) -> str:
    if 200 <= status < 300:
        return "2xx"
    if status in (503, 429, 504):
        return str(status)
    return "other"


@dataclass
class _Split:
    """Per-status histograms and the completion time line of one run."""

    t0: float
    pending: float | None = None
    by_class: dict[str, lt.LatencyRecorder] = field(default_factory=dict)
    timeline: dict[int, dict[str, int]] = field(default_factory=dict)
    filed: int = 0
    #: the same per-status histograms, only for responses that came on a new connection
    fresh_by_class: dict[str, lt.LatencyRecorder] = field(default_factory=dict)
    #: request task -> whether its last send went on a new connection (set by ``_fresh_send``)
    fresh: dict[object, bool] = field(default_factory=dict)

    def file(self, status: int) -> None:
        if self.pending is None:
            raise RuntimeError("status counted without a latency: numaserve.tools.loadtest changed; fix benchlib.engine")
        cls = status_class(status)
        self.by_class.setdefault(cls, lt.LatencyRecorder()).record(self.pending)
        if self.fresh.pop(asyncio.current_task(), False):
            self.fresh_by_class.setdefault(cls, lt.LatencyRecorder()).record(self.pending)
        if self.pending > SLOW_S:
            self.tick("slow")
        self.pending = None
        self.filed += 1
        self.tick(cls)

    def tick(self, what: str) -> None:
        b = int((time.perf_counter() - self.t0) / BIN_S)
        row = self.timeline.setdefault(b, {})
        row[what] = row.get(what, 0) + 1


_current: _Split | None = None


@dataclass
class _Result(lt.LoadResult):
    def __post_init__(self) -> None:
        assert _current is not None
        self.split = _current
        self.latency_hist = _SplitRecorder(_current)
        self.status_counts = _StatusCounts(_current)
        self.errors = _Errors(_current, self.errors)


_orig_send = lt._Conn.send


def _fresh_send(self: lt._Conn, data: bytes, head: bool) -> "asyncio.Future[tuple[int, bool]]":
    """``_Conn.send`` that notes, per request task, whether this is the connection's first request
    (the request then records its latency and status with no await in between: ``_Split.file``)."""
    split = _current
    if split is not None:
        split.fresh[asyncio.current_task()] = self.uses == 0
    return _orig_send(self, data, head)


@contextmanager
def _instrumented(t0: float) -> Iterator[_Split]:
    global _current
    with _patch_lock:
        _current = _Split(t0)
        orig = lt.LoadResult
        lt.LoadResult = _Result  # type: ignore[misc]
        lt._Conn.send = _fresh_send  # type: ignore[method-assign]
        try:
            yield _current
        finally:
            lt.LoadResult = orig  # type: ignore[misc]
            lt._Conn.send = _orig_send  # type: ignore[method-assign]
            _current = None


@dataclass
class Run:
    """One load run: the loadtest result plus the split views (times are ``perf_counter``)."""

    result: lt.LoadResult
    split: _Split
    started: float
    ended: float

    @property
    def ok(self) -> int:
        return self.split.by_class.get("2xx", lt.LatencyRecorder()).count

    def count(self, cls: str) -> int:
        rec = self.split.by_class.get(cls)
        return rec.count if rec else 0

    def summary(self, cls: str) -> dict[str, float] | None:
        rec = self.split.by_class.get(cls)
        return rec.summary_ms() if rec and rec.count else None

    def summary_fresh(self, cls: str) -> dict[str, float] | None:
        """``summary`` of the responses of class ``cls`` that came on a new connection."""
        rec = self.split.fresh_by_class.get(cls)
        return rec.summary_ms() if rec and rec.count else None

    def count_fresh(self, cls: str) -> int:
        rec = self.split.fresh_by_class.get(cls)
        return rec.count if rec else 0

    def within(self, cls: str, limit_s: float) -> int:
        """Responses of class ``cls`` at or under ``limit_s`` (bucket resolution, < 1 %)."""
        rec = self.split.by_class.get(cls)
        if rec is None:
            return 0
        lim = limit_s * 1e6
        return sum(c for lo, hi, c in rec.buckets() if hi <= lim or (lo <= lim and (lo + hi) / 2 <= lim))

    def fraction_under(self, cls: str, limit_s: float) -> float | None:
        n = self.count(cls)
        return None if n == 0 else self.within(cls, limit_s) / n

    def series(self, what: str = "2xx", until: float | None = None) -> list[tuple[float, int]]:
        """(seconds since start, completions of ``what`` in that BIN_S bucket), gaps as zeros."""
        tl = self.split.timeline
        last = int(((until or self.ended) - self.started) / BIN_S)
        return [(round(b * BIN_S, 3), tl.get(b, {}).get(what, 0)) for b in range(0, last + 1)]

    @property
    def errors(self) -> int:
        return self.result.error_count

    @property
    def failed(self) -> int:
        """Requests that did not get a 2xx: error responses and connection errors."""
        return self.result.non_2xx + self.result.error_count


def run(cfg: lt.LoadConfig, *, cpus: set[int] | None = None) -> Run:
    """Run ``cfg`` to completion on a fresh event loop in this thread.

    ``cpus`` pins the calling thread (the generator) for the run and restores
    its affinity afterwards.
    """
    before = os.sched_getaffinity(0)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    t0 = time.perf_counter()
    try:
        with _instrumented(t0) as split:
            res = lt.run_load(cfg)
    finally:
        if cpus is not None:
            os.sched_setaffinity(0, before)
    t1 = time.perf_counter()
    if split.filed != res.requests or sum(r.count for r in split.by_class.values()) != res.requests:
        raise RuntimeError(f"bench engine filed {split.filed} of {res.requests} responses: "
                           "numaserve.tools.loadtest changed; fix benchlib.engine")
    return Run(res, split, t0, t1)


class Background:
    """``run()`` in a thread, for scenarios that act on the server during the load."""

    def __init__(self, cfg: lt.LoadConfig, cpus: set[int] | None = None) -> None:
        self.cfg = cfg
        self.cpus = cpus
        self.out: Run | None = None
        self.exc: BaseException | None = None
        self.started = math.nan
        self._t = threading.Thread(target=self._main, name="bench-load", daemon=True)

    def _main(self) -> None:
        try:
            self.out = run(self.cfg, cpus=self.cpus)
        except BaseException as e:  # noqa: BLE001 - re-raised in join()
            self.exc = e

    def start(self) -> "Background":
        self.started = time.perf_counter()
        self._t.start()
        return self

    def running(self, wait_s: float = 0.0) -> bool:
        """Wait up to ``wait_s`` for the run to end; True while it still runs."""
        self._t.join(wait_s)
        return self._t.is_alive()

    def join(self) -> Run:
        self._t.join(self.cfg.duration + self.cfg.timeout + 30)
        if self._t.is_alive():
            raise RuntimeError("load thread did not finish in its bound")
        if self.exc is not None:
            raise self.exc
        assert self.out is not None
        return self.out
