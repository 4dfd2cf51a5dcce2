"""L0, limiter "cpu": shed on what a worker is short of — event-loop (CPU) time — and nothing else.

A worker is one event loop on one CPU.  Requests that await I/O, streams
between two chunks and uploads still arriving use none of it, so they never
count.  Two signals say the loop is short:

* **loop lag** — how late a probe timer fires (the shell's ``LoopProbe``
  re-arms it ``probe_delay()`` after each firing, so while the loop is busy it
  fires once per loop iteration and the lag is the length of that iteration:
  the time every ready callback waits for its turn).  Smoothed; *short of CPU*
  while above ``lag_target_s``.
* **requests waiting for CPU** — the caller counts runnable tasks (ready to
  run, not awaiting anything: ``task._fut_waiter is None``) when the decision
  needs it, plus one when threads other than the loop burn ≥ half a CPU
  (sync handlers run in a thread pool).

A request is shed (503) only when the loop is short of CPU (or has been
overloaded — busy without an idle moment for a while, while work arrives faster
than the CPU does it) **and** at least
``cpu_concurrency`` other requests already wait for it, worth at least
``overload_wait_s`` of CPU (so 8 clients of a 5 ms endpoint queue, 3 of a
20 ms one do not).  The second condition
keeps a small queue so the CPU never idles while requests wait: a request
arriving behind one blocking call, or next to one cooperative job, is always
admitted; only the ones that would wait behind several are refused.  With
cooperative CPU-bound requests this bounds their number to
``cpu_concurrency`` (latency ≈ that many × the work); with handlers that
block the loop it bounds the requests queued inside the worker, and the
sentinel (``numaserve.worker.shedding``) bounds the accept queue.

A burst that outgrows its bound while work arrives ≥ ``OVERLOAD_ARRIVAL_RATIO``
× as fast as the CPU does it (counted over the loop's current busy spell) is
the start of an overload: the gate says *overloaded* at once instead of after
~1.5 s of continuous work (``_maybe_start_overload``).

Also here: an in-flight safety cap (``max_inflight`` and the supervisor's
lease ceiling; 0/None = none, the default: streams never hit a cap), the
supervisor's rate quota (429), client deadlines (504), the counters and the
decision every sentinel makes (``stall_excess``: leave in the accept queue only what the
gate would admit once the loop is back).  Pure: every call takes
``now``; no clock, no I/O.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable

import msgspec

from numaserve.loops.admission import (
    AdmissionSettings,
    Admit,
    Outcome,
    PushedLimits,
    Reject,
    _Rate,
)
from numaserve.refusals import REFUSAL_STATUS

__all__ = ["CpuGate", "CpuGateStats", "CpuPermit", "LagTracker"]

#: Other threads burning at least this many CPUs count as one request waiting for CPU.
OTHER_THREADS_BUSY = 0.5
#: A probe later than its period plus this means the loop had work queued (it was not waiting
#: in poll); covers the 1 ms timer resolution of uvloop.
BUSY_LAG_S = 0.0005
#: The loop counts as refusing (a sentinel then leaves it no queued connection) until this many of its
#: iterations (probe firings) passed without a refusal for CPU.
REFUSING_ITERATIONS = 2
#: What a request costs before any was measured.
REQUEST_CPU_PRIOR_S = 0.002
#: The per-request CPU is the lowest of this many recent windows.
COST_WINDOWS = 8
#: Window of the thread-CPU measurement.
CPU_WINDOW_S = 0.05
#: A burst that outgrows its bound starts an overload at once when the work that arrived during the
#: loop's current busy spell (requests admitted or refused, by the learnt CPU) is at least this many
#: times the spell's length: work comes in faster than the CPU can do it, so the queue will not drain.
#: Near capacity the queue reaches the bound by chance, after a long spell (ratio ~1): not promoted.
OVERLOAD_ARRIVAL_RATIO = 1.5
#: ... and the spell is at least this long (a handful of requests is no rate).
OVERLOAD_MIN_SPELL_S = 0.02
#: A loop busy without pause (``busy_threshold``) counts as overloaded only while work also arrives
#: at least this many times as fast as its CPU does it (smoothed over ``ARRIVAL_TAU_S``): near
#: capacity (0.9x, each worker at ~0.8 of its CPU) a second without an idle moment is chance, and
#: the strict overload bound then refused a few % of requests a queue would have served.
SUSTAINED_ARRIVAL_RATIO = 1.1
ARRIVAL_TAU_S = 1.0
#: A finished request's outcome -> the counter it adds to.
_OUTCOME_COUNTER = {"ok": "ok", "dropped": "504", "ignored": "500", "bad_request": "400"}


class CpuPermit:
    """An admitted request of the "cpu" limiter (one is made per request, so: four slots, no id,
    no dataclass machinery).  Same fields as ``Permit`` where they mean the same: ``enqueued_at``
    (arrival, back-dated by the shell), ``deadline``, ``outcome``, ``released``; ``conn`` is the
    shell's connection object (its client-gone check), None when unknown; ``task`` the asyncio
    task running the request once there is one (the owner ``numaserve.worker.permits`` audits)."""

    __slots__ = ("conn", "deadline", "enqueued_at", "outcome", "released", "task")

    def __init__(self, enqueued_at: float, deadline: float | None) -> None:
        self.enqueued_at = enqueued_at
        self.deadline = deadline
        self.outcome: Outcome = "ok"
        self.released = False
        self.conn: object = None
        self.task: object = None

    @property
    def granted_at(self) -> float:
        return self.enqueued_at

    @property
    def permit(self) -> CpuPermit:
        """``Admit.permit`` (the permit is its own admission decision)."""
        return self


class LagTracker:
    """Smoothed loop lag from probe samples, and the probe's next period.

    The period is ``probe_min_s`` while the loop is busy (every sample then
    measures one loop iteration) and doubles up to ``probe_max_s`` while the
    samples are ~0 (a quiet loop is not woken 1000 times a second).
    New work after a quiet spell (no probe for ``busy_window_s``) brings it
    back to the minimum; not after every gap between two requests (with 32
    workers on 2 CPUs each gap is longer than ``probe_max_s``, and a 1 ms
    probe per request woke every worker for nothing).
    """

    __slots__ = (
        "at",
        "busy",
        "busy_lag",
        "last",
        "max_since",
        "period",
        "pmax",
        "pmin",
        "samples",
        "target",
        "tau",
        "value",
        "weight",
    )

    def __init__(self, s: AdmissionSettings, now: float) -> None:
        self.target = s.lag_target_s
        self.weight = s.lag_smoothing
        self.pmin = s.probe_min_s
        self.pmax = s.probe_max_s
        self.value = 0.0
        self.last = 0.0
        self.max_since = 0.0
        self.at = now
        self.period = s.probe_min_s
        self.samples = 0
        self.busy = 0.0            # time-smoothed share of time the loop had no idle moment
        self.tau = s.busy_window_s
        self.busy_lag = s.probe_min_s + BUSY_LAG_S

    def sample(self, now: float, lag: float, loop_ran: float | None = None) -> None:
        """One probe firing, ``lag`` s late.  ``loop_ran``: CPU the loop's thread used since the
        previous firing (None: unknown).  A late firing shortens the period only if the loop ran
        for at least half of the time since the previous firing: late because the OS did not
        schedule the process (more workers than CPUs), probing more often measures nothing new
        and only adds wake-ups."""
        lag = max(0.0, lag)
        dt = now - self.at
        was_busy = lag > self.busy_lag
        if dt > 0:  # busy for the lag and the period before it (at most), idle before that
            busy_dt = min(dt, lag + self.period) if was_busy else 0.0
            self._decay(dt - busy_dt, 0.0)
            self._decay(busy_dt, 1.0)
        self.value += self.weight * (lag - self.value)
        self.last = lag
        self.max_since = max(self.max_since, lag)
        self.at = now
        self.samples += 1
        if lag > self.pmin and (loop_ran is None or 2.0 * loop_ran >= dt):
            self.period = self.pmin
        else:
            self.period = min(self.pmax, self.period * 2)

    def _decay(self, dt: float, toward: float) -> None:
        if dt > 0:
            self.busy += (1.0 - math.exp(-dt / self.tau)) * (toward - self.busy)

    def kick(self) -> None:
        self.period = self.pmin

    def current(self, now: float, active: bool = True) -> float:
        """The smoothed lag, at least how overdue the armed probe is now (a loop stuck in a long
        iteration has not fired it yet); 0 once an unarmed probe has been quiet a while (idle worker)."""
        if active:
            return max(self.value, now - (self.at + self.period))
        return 0.0 if now - self.at > 2 * self.pmax + self.value else self.value

    def short(self, now: float, active: bool = True) -> bool:
        return self.current(now, active) > self.target

    def sustained(self, now: float, on: float, off: float, was: bool) -> bool:
        """Overload, not a burst: busy without an idle moment for the share ``on`` of the recent past
        (time constant ``busy_window_s``); it lasts until that share falls below ``off`` (no flapping)."""
        return self.busy >= (off if was else on)


class CpuGateStats(msgspec.Struct, kw_only=True):
    """Counters (cumulative) and current state for the worker's Stats (``extra["admission"]``).

    ``limiter``, ``l1_limit``, ``codel_overloaded`` and ``probing`` are the fields the
    removed gradient/static limiters filled too (always "cpu", None, overloaded, False), kept
    so the supervisor's limits loop and status readers need no second shape.
    """

    limiter: str
    epoch: int
    limit: int | None               # in-flight cap in force (None: none)
    l1_limit: float | None
    ceiling: int | None
    lease_expired: bool
    rate: float
    burst: float
    inflight: int
    queued: int
    max_inflight: int
    admitted: int
    completed: int
    ok: int
    status_400: int
    status_429: int
    status_500: int
    status_503: int
    status_504: int
    shed: dict[str, int]            # by reason (numaserve.refusals): cpu, stalled, limit, quota, deadline, connections
    client_gone: int                # not run: the client had left before the request started
    codel_overloaded: bool          # the same as "overloaded" (the field the limits loop reads)
    short_of_cpu: bool
    overloaded: bool                # busy without an idle moment for a while: the tight bound applies
    shedding: bool                  # shed within overload_hold_s
    lag_s: float                    # smoothed loop lag
    lag_max_s: float                # largest probe lag since the previous snapshot
    other_threads_cpu: float        # CPUs burnt by threads other than the loop (thread pools)
    request_cpu_s: float            # the loop's CPU per finished request (lowest of recent windows)
    throughput: float
    probing: bool = False


class CpuGate:
    """The pure "cpu" limiter; see the module docstring."""

    def __init__(self, settings: AdmissionSettings, now: float, rng: random.Random | None = None) -> None:
        self.s = settings
        self._rng = rng or random.Random()
        self.lag = LagTracker(settings, now)
        self.pushed = PushedLimits(settings.burst_fraction, now)
        self._throughput = _Rate(settings.throughput_tau_s, now)
        self.inflight = 0
        self.live: set[CpuPermit] = set()   # the permits not released: len(live) == inflight, always
        self.waiting = 0       # requests waiting for CPU at the last short-of-CPU decision, less those done since
        self._max_inflight = 0
        self._last_shed = -math.inf
        self._loop_shed_at = -math.inf   # the loop's own last "cpu" refusal (not a sentinel's) ...
        self._refusing = 0               # ... and the loop iterations left before it counts as not refusing
        self._overloaded = False
        self._cpu_at: float | None = None
        self._cpu_loop = 0.0
        self._cpu_proc = 0.0
        self.other_threads_cpu = 0.0
        self.request_cpu_s = REQUEST_CPU_PRIOR_S   # the loop's CPU per request (learnt)
        self._cpu_done = 0
        self._costs: deque[float] = deque(maxlen=COST_WINDOWS)
        self._capped = bool(settings.max_inflight)   # an in-flight cap may apply (else limit() is None)
        self._unfolded = 0                            # completions not yet added to the throughput rate
        self._probe_stopped = True                    # the shell's probe is not armed (see probe_wanted)
        self._arrivals = 0                            # requests that reached the CPU decision (cumulative)
        self._spell_at = now                          # the loop's last idle moment (probe on time) ...
        self._spell_n = 0                             # ... and _arrivals then
        self.arrival_rate = 0.0                       # requests/s reaching the CPU decision, smoothed
        self._arr_at, self._arr_n = now, 0
        self._c: dict[str, int] = dict.fromkeys(
            ("admitted", "completed", "ok", "400", "429", "500", "503", "504", "gone"), 0)
        self._shed: dict[str, int] = {}

    # --- limits ------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.pushed.epoch

    def set_limits(self, now: float, epoch: int, **kw: object) -> bool:
        """The supervisor's push (``PushedLimits.set``); the ceiling caps requests in flight."""
        applied = self.pushed.set(now, epoch, **kw)  # type: ignore[arg-type]
        self._capped = bool(self.s.max_inflight) or not self.pushed.uncapped()
        return applied

    def limit(self, now: float) -> int | None:
        """In-flight cap: min(``max_inflight``, lease ceiling); None when there is none."""
        cap = self.s.max_inflight or None
        ceil = self.pushed.ceiling(now)
        if ceil is not None:
            cap = ceil if cap is None else min(cap, ceil)
        return cap

    # --- loop signals ------------------------------------------------------------------------

    def on_lag(self, now: float, lag: float, loop_ran: float | None = None) -> None:
        """A probe fired ``lag`` seconds late (``loop_ran``: the loop thread's CPU since the
        previous firing, if the shell measured it; see ``LagTracker.sample``)."""
        tr = self.lag
        if self._refusing and self._loop_shed_at < tr.at:   # an iteration without a refusal for CPU
            self._refusing -= 1
        if lag <= tr.busy_lag:           # an idle moment: a new busy spell starts after it
            self._spell_at, self._spell_n = now, self._arrivals
        elif now - tr.at > lag + tr.period + BUSY_LAG_S:   # idle before this (late) firing
            self._spell_at, self._spell_n = now - lag - tr.period, self._arrivals
        tr.sample(now, lag, loop_ran)
        self._probe_stopped = not self.probe_wanted()
        if self._unfolded:
            self._fold(now)
        dt = now - self._arr_at
        if dt >= CPU_WINDOW_S:
            n = self._arrivals - self._arr_n
            self.arrival_rate += (1.0 - math.exp(-dt / ARRIVAL_TAU_S)) * (n / dt - self.arrival_rate)
            self._arr_at, self._arr_n = now, self._arrivals
        was = self._overloaded
        self._overloaded = self.lag.sustained(now, self.s.busy_threshold, self.s.busy_release, was) and (
            was or self.arrival_rate * self.request_cpu_s >= SUSTAINED_ARRIVAL_RATIO)

    def on_cpu(self, now: float, loop_cpu_s: float, process_cpu_s: float) -> None:
        """Cumulative CPU of the loop's thread and of the whole process (thread-pool work = the difference)."""
        if self._cpu_at is None:
            self._cpu_at, self._cpu_loop, self._cpu_proc = now, loop_cpu_s, process_cpu_s
            return
        dt = now - self._cpu_at
        if dt < CPU_WINDOW_S:
            return
        other = (process_cpu_s - self._cpu_proc) - (loop_cpu_s - self._cpu_loop)
        self.other_threads_cpu = max(0.0, other / dt)
        done = self._c["completed"] - self._cpu_done
        used = loop_cpu_s - self._cpu_loop
        if done > 0:  # the loop's CPU per finished request: the lowest of the recent windows
            self._costs.append(used / done)   # (a cold start is no rule)
            self.request_cpu_s = min(self._costs)
        elif not self._costs and self.inflight > 0:
            # nothing finished yet (a fresh worker's first requests): each request in flight got
            # used / inflight of CPU on average in this window and is not done, so that is a lower
            # bound of what they cost; the prior (2 ms) alone let a fresh worker queue 50 of them
            self.request_cpu_s = max(self.request_cpu_s, used / self.inflight)
        self._cpu_at, self._cpu_loop, self._cpu_proc = now, loop_cpu_s, process_cpu_s
        self._cpu_done = self._c["completed"]

    def probe_delay(self) -> float:
        return self.lag.period

    def probe_wanted(self) -> bool:
        """Re-arm the probe after a firing: while requests are in flight, and while the period has
        not yet grown to its maximum (a worker between two requests of a steady flow keeps a
        slow probe instead of stopping it and re-arming at the minimum period per request)."""
        return self.inflight > 0 or self.lag.period < self.lag.pmax

    def short_of_cpu(self, now: float) -> bool:
        return self.lag.short(now, self.inflight > 0)

    def overloaded(self, now: float) -> bool:
        """Sustained overload: the loop has been busy without pause (``busy_threshold``) for a window."""
        return self._overloaded

    @property
    def last_shed(self) -> float:
        """When a request was last shed (by the gate or a sentinel); -inf: never."""
        return self._last_shed

    def shedding(self, now: float) -> bool:
        """A request was shed within ``overload_hold_s`` (by the gate or a sentinel)."""
        return now - self._last_shed <= self.s.overload_hold_s

    # --- per request -------------------------------------------------------------------------

    def try_admit(self, now: float, *, deadline: float | None = None,
                  runnable: tuple[int, int] | Callable[[], tuple[int, int]] = (0, 0)) -> Admit | Reject:
        """``admit`` as a decision type (``Admit(permit)`` or ``Reject``), for callers that match on it."""
        d = self.admit(now, deadline, runnable)
        return d if type(d) is Reject else Admit(d)  # type: ignore[arg-type]

    def admit(self, now: float, deadline: float | None = None,
              runnable: tuple[int, int] | Callable[[], tuple[int, int]] = (0, 0)) -> CpuPermit | Reject:
        """Admit (the permit) or refuse at once.

        ``runnable``: (tasks ready to run that already ran a step, tasks not started yet) besides
        this request, or a function counting them (called only when the loop is short of CPU).
        Overloaded, both are queue.  In a burst all of them count by their expected CPU
        (``request_cpu_s`` × count against ``burst_wait_s``): 40 new awaits are not 40 CPU jobs.

        The common path (no quota, no cap, loop not short of CPU) is a few attribute reads: it
        runs once per request.
        """
        if deadline is not None and now >= deadline:
            return self._reject(now, 504, "deadline")
        bucket = self.pushed.bucket
        if bucket.rate > 0 and not bucket.try_take(now):
            wait = bucket.wait_time(now)
            return self._reject(now, 429, "quota", retry_after=self._clamp_retry(math.ceil(wait)))
        if self._capped:
            cap = self.limit(now)
            if cap is not None and self.inflight >= cap:
                return self._reject(now, 503, "limit",
                                    retry_after=self._overload_retry(now))
        self._arrivals += 1
        lag = self.lag
        target = lag.target
        if (self._overloaded or lag.value > target
                or (self.inflight > 0 and now - (lag.at + lag.period) > target)) \
                and (self._overloaded or lag.short(now, self.inflight > 0)):
            started, new = runnable() if callable(runnable) else runnable
            if self.other_threads_cpu >= OTHER_THREADS_BUSY:
                started += 1
            waiting = started + new
            if self._overloaded:   # a queue, and worth more than overload_wait_s of CPU
                refuse = (waiting >= self.s.cpu_concurrency
                          and waiting * self.request_cpu_s >= self.s.overload_wait_s)
            else:
                refuse = started >= self.s.cpu_burst or waiting * self.request_cpu_s >= self.s.burst_wait_s
                if refuse:
                    self._maybe_start_overload(now)
            self.waiting = waiting if refuse else waiting + 1
            if refuse:
                return self._reject(now, 503, "cpu", retry_after=self._overload_retry(now))
        n = self.inflight = self.inflight + 1
        if n > self._max_inflight:
            self._max_inflight = n
        self._c["admitted"] += 1
        if self._probe_stopped:    # the shell arms the stopped probe now
            self._probe_stopped = False
            self._spell_at, self._spell_n = now, self._arrivals - 1   # it stopped: the loop was idle
            if now - lag.at > lag.tau:   # new work after a quiet spell (busy_window_s): the short period
                lag.period = lag.pmin
        permit = CpuPermit(now, deadline)
        self.live.add(permit)
        return permit

    def _maybe_start_overload(self, now: float) -> None:
        """A burst outgrew its bound: if work arrived during this busy spell at least
        ``OVERLOAD_ARRIVAL_RATIO`` × as fast as the CPU does it, this is the start of an overload,
        not a burst: overloaded from now on, not after the busy share has climbed to
        ``busy_threshold`` (~1.5 s of continuous work, while the burst bound let every loop
        iteration grow to ``burst_wait_s`` and the admitted requests and the 503s all waited for
        those iterations).  The share is set to the threshold, so the usual hysteresis ends it (a
        loop with idle moments falls under ``busy_release`` after ~``busy_window_s`` ×
        ln(threshold / release) of idle time, ~90 ms by default)."""
        spell = now - self._spell_at
        if spell < OVERLOAD_MIN_SPELL_S:
            return
        if (self._arrivals - self._spell_n) * self.request_cpu_s >= OVERLOAD_ARRIVAL_RATIO * spell:
            lag = self.lag
            lag.busy = max(lag.busy, self.s.busy_threshold)
            self._overloaded = True

    def release(self, now: float, permit: CpuPermit, outcome: Outcome | None = None) -> None:
        """A request finished (any outcome).  The throughput rate takes it at the next probe
        sample or snapshot (one exp() per probe period, not per request)."""
        if permit.released:
            return
        permit.released = True
        self.live.discard(permit)  # type: ignore[arg-type]
        if self.inflight > 0:
            self.inflight -= 1
        if self.waiting > 0:
            self.waiting -= 1
        c = self._c
        c["completed"] += 1
        c[_OUTCOME_COUNTER[outcome or permit.outcome]] += 1
        self._unfolded += 1

    def _fold(self, now: float) -> None:
        self._throughput.add(now, self._unfolded)
        self._unfolded = 0

    def client_gone(self, now: float, permit: CpuPermit | None = None) -> None:
        """An admitted request whose client left before it started: not run."""
        self._c["gone"] += 1
        if permit is not None and not permit.released:
            permit.released = True
            self.live.discard(permit)  # type: ignore[arg-type]
            self.inflight = max(0, self.inflight - 1)

    # --- the sentinel ------------------------------------------------------------------------

    def stall_excess(self, now: float, stalled_for: float, accept_queue: int) -> int:
        """How many connections a sentinel should answer 503 from an accept queue of this length.

        Only while the loop is stalled: its probe is ``stall_after_s`` late
        when it was already short of CPU, else ``stall_idle_after_s`` (a
        single long call on a quiet worker is not overload).  What stays for
        the loop is what its own gate would admit once it is back: the loop
        is back when the call running now ends (its learnt CPU less the
        ``stalled_for`` it has run; a call already longer than that is
        guessed to run as long again) and the requests already waiting for
        CPU behind it have run (``waiting`` counts the running one); the
        connections whose learnt CPU fits in what is left of
        ``overload_wait_s`` after that stay, every other one is answered now.
        Left in the queue, the loop would refuse them itself, a call and a
        loop iteration later (issue 32: the sentinel kept ~2 behind each 20 ms
        call at 2x capacity, and most 503s on new connections waited a
        quarter of a second for the loop).  While the loop itself is refusing
        requests for CPU (``loop_refusing``) none stays: the loop has
        more work than CPU from its open connections (keep-alive clients),
        and a connection left for it was refused a loop iteration later
        (2x capacity, blocking: 68 of 76 new-connection 503s came from the
        loop, p50 66 ms, where the sentinel's took 19 ms).  With nothing waiting behind the
        call at least ``stall_queue`` stay (so the loop has work the moment it
        is back).  A 5 ms handler that blocks the loop is a stall every call;
        8 clients of it queue ~35 ms and are all served, while behind a 20 ms
        one 2 stay, behind a 20 ms one with two more queued none, and behind a
        long call ``stall_queue``.
        """
        if self.inflight <= 0:
            return 0
        if stalled_for < self.stall_limit(now, accept_queue):
            return 0
        if self.loop_refusing(now):
            # the loop itself refuses what it already reads (keep-alive requests beyond its CPU):
            # a connection left here would wait a call and an iteration for the same 503
            return accept_queue
        cpu = self.request_cpu_s
        if stalled_for < self.stall_limit(now):
            # only the queue is short of CPU (``queue_short``): what the burst bound admits stays
            keep = max(self.s.stall_queue, math.floor(self.s.burst_wait_s / cpu) if cpu > 0 else accept_queue)
            return max(0, accept_queue - keep)
        behind = max(0, self.waiting - 1)
        back_in = (cpu - stalled_for if stalled_for < cpu else stalled_for) + behind * cpu
        budget = self.s.overload_wait_s - back_in
        keep = math.ceil(budget / cpu) if budget > 0 and cpu > 0 else 0
        if behind == 0:
            keep = max(keep, self.s.stall_queue)
        return max(0, accept_queue - keep)

    def loop_refusing(self, now: float) -> bool:
        """The loop refused a request for CPU in one of its last ``REFUSING_ITERATIONS`` iterations
        (counted in iterations, not seconds: one long iteration is no quiet spell), within
        ``overload_hold_s``."""
        return self._refusing > 0 and now - self._loop_shed_at <= self.s.overload_hold_s

    def stall_limit(self, now: float, queued: int = 0) -> float:
        """How late the probe must be for a sentinel to act: ``stall_after_s`` while the loop is
        short of CPU (overloaded, or its gate shed within ``overload_hold_s``) or ``queued``
        connections wait with more CPU than a burst may (``queue_short``), else
        ``stall_idle_after_s``.  Read by the sentinel thread (plain attribute reads, no lock)."""
        if (self._overloaded or now - self._last_shed <= self.s.overload_hold_s
                or self.queue_short(queued)):
            return self.s.stall_after_s
        return self.s.stall_idle_after_s

    def queue_short(self, queued: int) -> bool:
        """``queued`` connections in the accept queue hold more CPU than the burst bound lets wait
        (``burst_wait_s``): an overload starting on a loop that has not refused anything yet.  At
        its onset (2x capacity, 20 ms handlers) the loop ran one call after another, 11
        connections queued behind them, and the sentinel, held to ``stall_idle_after_s``, let them
        wait 140-360 ms.  At least ``cpu_burst`` of them: a quiet worker's long call with a few
        connections queued is not this, nor 3 clients reconnecting to an emulated CPU whose every
        request costs ~35 ms (the systemd VM's stop under load got a 503 from it)."""
        return queued >= self.s.cpu_burst and queued * self.request_cpu_s >= self.s.burst_wait_s

    def record_stall_shed(self, now: float, n: int = 1) -> None:
        """The shell's sentinel answered ``n`` connections (called on the loop, or merged from counters)."""
        if n > 0:
            self._c["503"] += n
            self._shed["stalled"] = self._shed.get("stalled", 0) + n
            self._last_shed = max(self._last_shed, now)
            self._arrivals += n

    def count_refusal(self, reason: str) -> None:
        """A refusal decided outside the gate (``connections``: ``server.max_connections``), counted
        with the gate's own so status and metrics show every reason of ``numaserve.refusals``."""
        self._c[str(REFUSAL_STATUS[reason])] += 1
        self._shed[reason] = self._shed.get(reason, 0) + 1

    def note_shed(self, now: float) -> None:
        """A shed seen outside this gate (a sentinel thread): keeps ``shedding`` on."""
        self._last_shed = max(self._last_shed, now)

    def retry_after(self, now: float) -> int:
        return self._overload_retry(now)

    # --- stats -------------------------------------------------------------------------------

    def snapshot(self, now: float, *, reset_max: bool = False) -> CpuGateStats:
        if self._unfolded:
            self._fold(now)
        c = self._c
        short = self.short_of_cpu(now)
        st = CpuGateStats(
            limiter="cpu", epoch=self.epoch, limit=self.limit(now), l1_limit=None,
            ceiling=self.pushed.ceiling(now), lease_expired=self.pushed.lease_expired(now),
            rate=self.pushed.bucket.rate, burst=self.pushed.bucket.burst, inflight=self.inflight, queued=0,
            max_inflight=self._max_inflight, admitted=c["admitted"], completed=c["completed"], ok=c["ok"],
            status_400=c["400"], status_429=c["429"], status_500=c["500"], status_503=c["503"],
            status_504=c["504"], shed=dict(self._shed), client_gone=c["gone"], codel_overloaded=self._overloaded,
            short_of_cpu=short, overloaded=self._overloaded, shedding=self.shedding(now), lag_s=round(self.lag.current(now, self.inflight > 0), 6),
            lag_max_s=round(self.lag.max_since, 6), other_threads_cpu=round(self.other_threads_cpu, 3),
            request_cpu_s=round(self.request_cpu_s, 6),
            throughput=self._throughput.get(now),
        )
        if reset_max:
            self._max_inflight = self.inflight
            self.lag.max_since = 0.0
        return st

    # --- internals ---------------------------------------------------------------------------

    def _reject(self, now: float, status: int, reason: str, retry_after: int | None = None) -> Reject:
        self._c[str(status)] += 1
        self._shed[reason] = self._shed.get(reason, 0) + 1
        if status == 503:
            self._last_shed = now
            if reason == "cpu":
                self._loop_shed_at = now
                self._refusing = REFUSING_ITERATIONS
        return Reject(status, retry_after, reason)

    def _clamp_retry(self, seconds: float) -> int:
        return int(min(max(seconds, self.s.retry_after_min_s), self.s.retry_after_max_s))

    def _overload_retry(self, now: float) -> int:
        """Retry-After: 1 or 2 s at random (refused clients do not all come back together)."""
        return self._clamp_retry(1 + (self._rng.random() < 0.5))
