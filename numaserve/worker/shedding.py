"""The I/O shell around the "cpu" limiter (``numaserve.loops.cpu_gate``): probe, protocol hook, sentinel.

* ``LoopProbe`` — a timer on the event loop, re-armed after every firing
  while requests are in flight (and until its period has grown back to the
  maximum); how late it fires is the loop lag the gate sheds on.  It also stamps ``beat`` (the sentinel's freshness signal) and
  samples the CPU of the loop's thread and of the process (thread pools).
* the protocol hook — the worker's HTTP protocol (``numaserve.worker.
  httpproto``) decides admission when a request's head is complete, before
  any task is created, with the helpers here: a refused request costs no
  task, no ASGI call and is answered (``reject_response``: 503 +
  Retry-After + ``x-numaserve-refusal``, the connection kept when the
  request's body is in) in the same loop iteration its bytes were read.  When the loop was late it reads the socket's ``TCP_INFO``
  (``tcp_wait_and_state``): ``tcpi_last_data_recv`` (how long the request
  sat in the kernel) back-dates its arrival, and a ``CLOSE_WAIT`` state
  (the client already gave up and closed) means the request is not run.
* ``Sentinel`` — a thread per worker.  While the loop is stalled (one call
  holding it: a blocking handler) the in-loop gate cannot act; the thread
  sleeps in ``poll()`` on the listener until a connection waits in its accept
  queue (with keep-alive clients: never), checks whether the loop is stalled,
  reads the queue's length (``TCP_INFO`` on the listening socket), leaves
  what the loop's gate would admit (``CpuGate.stall_excess``: at least
  ``stall_queue``) and answers the oldest others
  with 503 ``stalled`` and ``Connection: close`` from outside the loop (the
  loop never sees those connections, so they cannot stay open).  It needs the
  GIL: pure-Python code releases it every ``sys.getswitchinterval()`` (5 ms)
  and most C extensions around heavy work; a C call that holds the GIL for
  long stalls the sentinel too (then only the supervisor's steering helps).
  Its accept/recv/send/shutdown/close are non-blocking libc calls that keep
  the GIL (``numaserve.net.heldsock``): ``socket`` methods drop and re-take
  it around each syscall, and each re-take waits up to a switch interval
  behind the loop (~25 ms per 503); so one acquisition per wake-up answers
  the whole excess.
  Connections it cannot answer (TLS, a non-HTTP first byte) are handed back
  to the loop untouched.

``AdmissionRuntime`` ties them to one worker's gate.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import math
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from numaserve.errors_http import error_body, error_headers
from numaserve.loops.admission import AdmissionSettings, Reject
from numaserve.loops.cpu_gate import CpuGate
from numaserve.net import heldsock
from numaserve.net.listeners import accept_queue_depth
from numaserve.refusals import refusal_header
from numaserve.worker.permits import PermitWatch
from numaserve.worker.stats import BUCKET_UPPER_MS, LatencyHistogram

__all__ = [
    "ARRIVED_KEY",
    "CONN_KEY",
    "PERMIT_KEY",
    "AdmissionRuntime",
    "LoopProbe",
    "RunnableCount",
    "Sentinel",
    "overload_response",
    "refusal_response",
    "reject_response",
    "tcp_wait_and_state",
]

#: Scope keys set by the protocol for the ASGI middleware.
PERMIT_KEY = "numaserve.permit"
ARRIVED_KEY = "numaserve.arrived"
CONN_KEY = "numaserve.conn"

DEADLINE_HEADER = b"x-request-timeout"
TCP_ESTABLISHED = 1
_TCP_INFO_LEN = 60
_LAST_DATA_RECV = struct.Struct("I")   # u32 at offset 52: ms since the last data arrived
#: The loop counts as late (worth a TCP_INFO look at new requests) past this lag.
LATE_S = 0.002
#: CPU (thread vs process) is sampled at most this often.
CPU_SAMPLE_S = 0.05
#: The gate's count of runnable tasks is taken again at most this often (``RunnableCount``).
RUNNABLE_REFRESH_S = 0.001


def tcp_wait_and_state(sock: Any) -> tuple[float, int] | None:
    """(seconds since data last arrived, TCP state) of a connected socket; None if not TCP."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except (OSError, AttributeError, TypeError):
        return None
    if len(info) < 56:
        return None
    return _LAST_DATA_RECV.unpack_from(info, 52)[0] / 1000.0, info[0]


_PHRASES = {503: b"Service Unavailable", 429: b"Too Many Requests", 504: b"Gateway Timeout"}


@functools.lru_cache(maxsize=128)
def refusal_response(status: int, reason: str, retry_after: int | None = None, *,
                     close: bool = True, head: bool = False) -> bytes:
    """A complete HTTP/1.1 refusal (JSON body, Retry-After for 503/429, ``x-numaserve-refusal``),
    built once per distinct answer (a few dozen: status × reason × Retry-After × close × HEAD).

    ``close``: say ``Connection: close`` (the caller closes after it); without it the
    connection stays usable for the client's next request.  ``head``: the request was a
    HEAD, so the body is left out (its length still declared): on a kept connection
    a body after a HEAD answer would be read as the next response."""
    body = error_body(status, f"request not admitted: {reason}")
    lines = [b"HTTP/1.1 " + str(status).encode() + b" " + _PHRASES.get(status, b"Error")]
    lines += [k + b": " + v for k, v in error_headers(status, body, retry_after or 1)]
    k, v = refusal_header(reason)
    lines.append(k + b": " + v)
    if close:
        lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + (b"" if head else body)


def overload_response(retry_after: int, reason: str = "cpu") -> bytes:
    """A complete HTTP/1.1 503 (JSON body, Retry-After, the reason, Connection: close)."""
    return refusal_response(503, reason, retry_after)


def reject_response(rej: Reject, *, close: bool = True, head: bool = False) -> bytes:
    """A complete HTTP/1.1 answer for a gate's refusal (503/429/504); see ``refusal_response``."""
    return refusal_response(rej.status, rej.reason, rej.retry_after or 1, close=close, head=head)


class LoopProbe:
    """The lag probe; see the module docstring.  ``beat``/``period`` are read by the sentinel thread."""

    def __init__(self, gate: CpuGate, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.gate = gate
        self.loop = loop
        self.beat = time.monotonic()
        self.period = gate.probe_delay()
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self._cpu_at = 0.0
        self._tt = time.thread_time()
        self.lag_hist = LatencyHistogram()

    def kick(self) -> None:
        """New work admitted: arm the probe if it was stopped (the gate chose its period)."""
        if self._handle is None:   # stopped while idle: the loop is running right now, not stalled
            now = time.monotonic()
            self.beat = now
            self._tt = time.thread_time()
            self._arm(now)

    def _arm(self, now: float) -> None:
        loop = self.loop or asyncio.get_running_loop()
        self.loop = loop
        d = self.gate.probe_delay()
        self.period = d
        self._due = now + d
        self._handle = loop.call_later(d, self._fire)

    def _fire(self) -> None:
        now = time.monotonic()
        tt = time.thread_time()   # the loop thread's CPU: was a late firing the loop's doing?
        self._handle = None
        lag = max(0.0, now - self._due)
        gate = self.gate
        gate.on_lag(now, lag, tt - self._tt)
        self._tt = tt
        self.lag_hist.observe(lag * 1000.0)
        self.beat = now
        if now - self._cpu_at >= CPU_SAMPLE_S:
            self._cpu_at = now
            gate.on_cpu(now, tt, time.process_time())
        if gate.probe_wanted():
            self._arm(now)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


def runnable_tasks() -> tuple[int, int]:
    """Tasks of this loop ready to run (not awaiting anything), the current one excluded:
    (those that already ran a step, those not started yet)."""
    cur = asyncio.current_task()
    started = new = 0
    for t in asyncio.all_tasks():
        if t is cur or t._fut_waiter is not None:  # type: ignore[attr-defined]
            continue
        if getattr(t.get_coro(), "cr_suspended", True):
            started += 1
        else:
            new += 1
    return started, new


class RunnableCount:
    """``runnable_tasks()`` for the gate, counted again at most every ``RUNNABLE_REFRESH_S``.

    The gate asks for the count on every admission while the loop is short of
    CPU, and a count walks every task of the loop (``asyncio.all_tasks()``,
    ~0.45 µs per task: 9 µs with 20 tasks).  The heads of one loop
    iteration's reads are parsed back to back, well inside a millisecond,
    so one count serves them all: the requests admitted since the count are
    added to it as tasks not started yet.  What the loop ran in between (at
    most ``RUNNABLE_REFRESH_S`` of it) is the count's error, small beside
    the work the gate weighs (``burst_wait_s``, ``overload_wait_s``).
    Measured live (``scripts/bench_sse.py``: one pinned worker streaming at full
    CPU): ~0.1 µs of a chunk's 8.7, 1.019× -> 1.004× uvicorn's CPU per chunk.
    """

    __slots__ = ("added", "at", "clock", "count", "new", "started")

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 count: Callable[[], tuple[int, int]] | None = None) -> None:
        self.clock = clock
        self.count = count      # None: this module's ``runnable_tasks``
        self.at = -math.inf
        self.started = self.new = self.added = 0

    def __call__(self) -> tuple[int, int]:
        now = self.clock()
        if now - self.at >= RUNNABLE_REFRESH_S:
            self.started, self.new = (self.count or runnable_tasks)()
            self.at = now
            self.added = 0
        return self.started, self.new + self.added

    def admitted(self) -> None:
        """A request was admitted since the count: one more task not started yet."""
        self.added += 1


class AdmissionRuntime:
    """One worker's "cpu" limiter: the gate, its probe, its sentinel and the delay histogram."""

    def __init__(self, settings: AdmissionSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.s = settings
        self.clock = clock
        self.gate = CpuGate(settings, clock())
        self.probe = LoopProbe(self.gate)
        self.sentinel: Sentinel | None = None
        self.delay_hist = LatencyHistogram()   # per admitted request: arrival -> start, ms
        self.edge_rejected: dict[int, int] = {}
        self.busy = threading.Event()          # set while requests are in flight (wakes the sentinel)
        self.runnable = RunnableCount(clock)   # what the gate asks for when short of CPU
        self.permits = PermitWatch()           # the in-flight invariant, checked with every snapshot

    # --- used by the protocol and the middleware ------------------------------------------

    def loop_late(self, now: float) -> bool:
        return self.gate.lag.last > LATE_S or now - self.probe.beat > self.probe.period + LATE_S

    def admitted(self, queued: bool = True) -> None:
        """A request was admitted (the gate already chose the probe's period): arm a stopped
        probe and wake the sentinel.  ``queued``: its task has not started yet (the protocol
        admits at head-complete), so it counts as runnable until the next count; a request
        admitted by its own running task (the edge: frames, pipelined requests) does not — it
        is the current task, and by the next decision it has finished or is waiting (counted
        as queued, 5,000 pipelined requests made ~2 % of them 503 on a quiet worker)."""
        if queued:
            self.runnable.admitted()
        self.probe.kick()   # arms it only if it stopped while idle
        if not self.busy.is_set():
            self.busy.set()

    def started(self, permit: Any, now: float) -> None:
        """An admitted request starts: its queue delay (arrival -> start) into the histogram,
        inline (``LatencyHistogram.observe`` costs a call, a ``max`` and a bisect call)."""
        ms = (now - permit.enqueued_at) * 1000.0
        h = self.delay_hist
        if ms <= 0.0:
            ms = 0.0
            h.counts[0] += 1
        else:
            h.counts[bisect.bisect_left(BUCKET_UPPER_MS, ms)] += 1
            if ms > h.max_ms:
                h.max_ms = ms
        h.count += 1
        h.sum_ms += ms

    def client_gone(self, conn: Any) -> bool:
        """The client of ``conn`` (a protocol) has closed or reset its connection."""
        transport = getattr(conn, "transport", None)
        if transport is None or transport.is_closing():
            return True
        got = tcp_wait_and_state(transport.get_extra_info("socket"))
        return got is not None and got[1] != TCP_ESTABLISHED

    # --- the sentinel --------------------------------------------------------------------------

    def start_sentinel(self, listeners: list[socket.socket], adopt: Callable[[socket.socket], None] | None) -> None:
        if not self.s.sentinel or self.sentinel is not None or not listeners or not heldsock.AVAILABLE:
            return
        self.sentinel = Sentinel(self, listeners, adopt)
        self.sentinel.start()

    def stop_sentinel(self) -> None:
        if self.sentinel is not None:
            self.sentinel.stop()
            self.sentinel = None

    # --- stats ---------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        self.permits.check(self.gate, now)
        snap = self.gate.snapshot(now, reset_max=True)
        out = {f: getattr(snap, f) for f in snap.__struct_fields__}
        sent = self.sentinel
        if sent is not None and sent.shed:
            out["shed"] = dict(out["shed"])
            out["shed"]["stalled"] = out["shed"].get("stalled", 0) + sent.shed
            out["status_503"] += sent.shed
        out["sentinel"] = None if sent is None else {"shed": sent.shed, "handed_back": sent.handed_back,
                                                     "stalls": sent.stalls, "client_gone": sent.gone}
        out["permits_orphaned"] = self.permits.released
        out["rejected_by_status"] = {str(k): v for k, v in self.edge_rejected.items()}
        # answered before any ASGI middleware saw them (the worker adds them to its status classes)
        out["unserved_by_status"] = {str(k): v for k, v in self.edge_rejected.items()}
        if sent is not None and sent.shed:
            out["unserved_by_status"]["503"] = out["unserved_by_status"].get("503", 0) + sent.shed
        for name, h in (("delay", self.delay_hist), ("lag", self.probe.lag_hist)):
            out[f"{name}_buckets"] = list(h.counts)
            out[f"{name}_count"] = h.count
            out[f"{name}_sum_ms"] = round(h.sum_ms, 3)
        return out


def request_deadline(headers: Any, arrived: float, default_s: float) -> float | None:
    """When the request must be answered: ``x-request-timeout`` seconds (or the default) after arrival."""
    for name, value in headers:
        if name == DEADLINE_HEADER:
            try:
                t = float(value)
            except ValueError:
                break
            if t > 0:
                return arrived + t
    return arrived + default_s if default_s > 0 else None


class Sentinel(threading.Thread):
    """Answers 503 from the accept queue while the loop is stalled (see the module docstring)."""

    #: Checks per second while the loop is stalled (each needs the GIL).
    STALL_POLL_S = 0.001
    #: Nothing in flight for this long: sleep on the ``busy`` event (the next admission sets it).
    PARK_AFTER_S = 1.0
    #: Longest sleep in poll() with nothing to answer (ms).
    IDLE_POLL_MS = 50.0
    #: A connection waits and the loop is not stalled (yet): look again this soon (at most 100
    #: wake-ups a second per worker while new connections keep arriving).
    QUEUED_LOOK_S = 0.01
    #: A shed connection whose request head has not arrived is answered after this long anyway.
    HEAD_WAIT_S = 0.05
    #: After the 503 and FIN, what the client still sends is read and dropped this long (no RST).
    LINGER_S = 1.0
    LINGER_READS = 4          # reads of a lingering connection per pass (64 KB each)

    def __init__(self, rt: AdmissionRuntime, listeners: list[socket.socket],
                 adopt: Callable[[socket.socket], None] | None) -> None:
        super().__init__(name="numaserve-sentinel", daemon=True)
        self.rt = rt
        self.adopt = adopt
        self._listeners = [socket.socket(fileno=os.dup(s.fileno())) for s in listeners]
        for s in self._listeners:
            s.setblocking(False)
        self._stop_evt = threading.Event()
        self._pending: list[tuple[int, float]] = []   # accepted fds, head not read yet
        self._listen_fds = {s.fileno() for s in self._listeners}
        # readable listener = a connection waits in its accept queue; readable pending fd = its head came
        self._poll = select.poll()
        for lst in self._listeners:
            self._poll.register(lst, select.POLLIN)
        self._linger: list[tuple[int, float]] = []
        self.shed = 0
        self.handed_back = 0
        self.stalls = 0
        self.gone = 0

    def stop(self, timeout: float = 1.0) -> None:
        self._stop_evt.set()
        self.rt.busy.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    def run(self) -> None:
        try:
            self._run()
        finally:
            for fd, _ in self._pending + self._linger:
                heldsock.close(fd)
            for s in self._listeners:
                s.close()

    def _run(self) -> None:
        rt = self.rt
        gate = rt.gate
        stalled_before = False
        queue = self._poll
        idle_since: float | None = None
        nap = self.QUEUED_LOOK_S
        while not self._stop_evt.is_set():
            if gate.inflight <= 0 and not self._pending and not self._linger:
                now = time.monotonic()
                if idle_since is None:
                    idle_since = now
                if now - idle_since < self.PARK_AFTER_S:
                    # between two requests of a flow: stay off the event (parking it here and
                    # setting it on the next admission takes its lock in both threads per gap), but
                    # in poll() on the listeners, not blind: the loop takes the next connection and
                    # may block on its handler at once, and the connections queued behind that call
                    # waited unseen for the rest of a blind 50 ms sleep (2x capacity, blocking
                    # handlers: a quarter of the sentinel's 503s came 55 ms late)
                    if any(fd in self._listen_fds for fd, _ in queue.poll(self.IDLE_POLL_MS)):
                        # the idle loop takes it now: look again after a nap (see ``_nap``)
                        nap = self._nap(nap)
                    continue
                rt.busy.clear()          # then look again: an admission in between sets it anew
                if gate.inflight <= 0:
                    rt.busy.wait(1.0)
                continue
            idle_since = None
            now = time.monotonic()
            probe = rt.probe
            stalled_for = now - probe.beat - probe.period
            limit = gate.stall_limit(now)
            if gate.s.stall_after_s <= stalled_for < limit and gate.inflight > 0:
                # stalled, not known short of CPU: is the accept queue alone? (a syscall per listener)
                limit = gate.stall_limit(now, sum(accept_queue_depth(lst) or 0 for lst in self._listeners))
            if stalled_for < limit or gate.inflight <= 0:
                stalled_before = False
                self._service(now)
                # Nothing to answer while every accept queue is empty (keep-alive traffic: always),
                # so sleep in poll() until a connection waits (the loop takes it at once if it can),
                # then until the loop could be stalled for ``limit``: no wake-ups per probe period
                # (32 workers on 2 CPUs: 32 threads taking the GIL from their loops ~1000 times a second).
                ready = queue.poll(self._idle_poll_ms())
                if any(fd in self._listen_fds for fd, _ in ready):
                    now = time.monotonic()
                    stalled_for = now - probe.beat - probe.period
                    left = limit - stalled_for
                    if left > 0:   # (the loop takes it if it can; stalled already: look again in 10 ms)
                        if stalled_for >= gate.s.stall_after_s:
                            self._stop_evt.wait(min(self.QUEUED_LOOK_S, max(self.STALL_POLL_S, left)))
                        else:
                            nap = self._nap(nap, left)
                continue
            if not stalled_before:
                self.stalls += 1
                stalled_before = True
            nap = self.QUEUED_LOOK_S   # stalls happen here: look soon after a connection comes
            waiting = 0
            for lst in self._listeners:
                depth = accept_queue_depth(lst) or 0
                waiting += depth
                for _ in range(gate.stall_excess(now, stalled_for, depth)):
                    if not self._take(lst, now):
                        break
            self._service(now)
            if waiting:    # connections wait (some left for the loop): look again in a moment
                self._stop_evt.wait(self.STALL_POLL_S)
            else:          # stalled (or not scheduled: more workers than CPUs) with nobody waiting:
                queue.poll(self._idle_poll_ms())   # nothing to answer until a connection or a head arrives

    def _nap(self, nap: float, left: float = math.inf) -> float:
        """A connection is queued and the loop is not stalled: it takes the connection itself, so
        sleep ``nap`` (at most ``left``) before looking again, and double the next one up to
        ``IDLE_POLL_MS``.  The nap is back to ``QUEUED_LOOK_S`` after each stall this thread
        acts on.  So a worker whose loop stalls (blocking handlers) is looked at 10 ms after a
        connection comes, while a new connection per request on a loop that never stalls does
        not wake this thread per connection (1 ms naps: 720 wake-ups a second for 2 workers, each
        taking the GIL from a loop, ~20 % fewer requests a second)."""
        self._stop_evt.wait(min(nap, max(self.STALL_POLL_S, left)))
        return min(nap * 2, self.IDLE_POLL_MS / 1000.0)

    def _idle_poll_ms(self) -> float:
        """How long to sleep in poll() when no connection waits: until pending heads and
        lingering closes need a look."""
        return self.IDLE_POLL_MS if not (self._pending or self._linger) else self.STALL_POLL_S * 10 * 1000.0

    def _take(self, lst: socket.socket, now: float) -> bool:
        fd = heldsock.accept(lst.fileno())   # (GIL held: see numaserve.net.heldsock)
        if fd < 0:
            return False
        self._answer_or_wait(fd, now + self.HEAD_WAIT_S)
        return True

    def _answer_or_wait(self, fd: int, deadline: float) -> None:
        """Answer ``fd`` (a shed connection) with 503, or keep it pending until its head arrives.
        Every call here keeps the GIL (one acquisition per batch, not one per syscall)."""
        n, first = heldsock.recv(fd, peek=True)
        if n == -heldsock.EAGAIN:
            if time.monotonic() < deadline:   # poll() wakes the thread when the head comes
                self._pending.append((fd, deadline))
                self._poll.register(fd, select.POLLIN)
                return
            first = b"G"  # nothing yet: answer anyway, the client is connected
        elif n < 0:
            heldsock.close(fd)
            return
        elif n == 0:           # the client already left: nothing to answer
            heldsock.close(fd)
            self.gone += 1
            return
        if not (65 <= first[0] <= 90) and self.adopt is not None:   # not an HTTP method: frames, TLS
            self.handed_back += 1
            self.adopt(socket.socket(fileno=fd))
            return
        heldsock.recv(fd)   # the head (what is there): read, so closing sends no RST
        now = time.monotonic()
        gate = self.rt.gate
        if heldsock.send(fd, overload_response(gate.retry_after(now), "stalled")) < 0 or heldsock.shutdown_wr(fd) < 0:
            heldsock.close(fd)
            return
        self.shed += 1
        gate.note_shed(now)
        self._linger.append((fd, now + self.LINGER_S))

    def _service(self, now: float) -> None:
        """Pending heads and lingering closes (non-blocking reads: no poll(), which drops the GIL)."""
        if self._pending:
            pending, self._pending = self._pending, []
            for fd, deadline in pending:
                self._poll.unregister(fd)
                self._answer_or_wait(fd, deadline)
        if self._linger:
            keep = []
            for fd, deadline in self._linger:
                done = now >= deadline
                for _ in range(self.LINGER_READS):   # bounded: a client that keeps sending cannot hold the GIL here
                    if done:
                        break
                    n, _ = heldsock.recv(fd)
                    if n == -heldsock.EAGAIN:
                        break
                    done = n <= 0   # EOF or an error: the client is done
                if done:
                    heldsock.close(fd)
                else:
                    keep.append((fd, deadline))
            self._linger = keep
