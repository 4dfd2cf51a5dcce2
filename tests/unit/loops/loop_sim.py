"""Deterministic simulation of one worker's event loop in front of the "cpu" limiter (``CpuGate``).

``loops_sim`` models M parallel servers; a numaserve worker is one event loop
on one CPU, and its traffic is not only CPU work.  This model:

* **the loop**: iterations of [due timers] → [every task made ready before
  the iteration, one step each; each step holds the CPU for its duration] →
  [I/O: accept every queued connection, read every request waiting in a
  socket buffer, decide admission for each] → sleep until the next timer or
  arrival when nothing is ready.  The probe timer re-arms itself
  ``gate.probe_delay()`` after each firing, exactly as ``LoopProbe`` does.
* **requests** (each a list of CPU steps separated by awaits):
  ``coop`` W ms of CPU in S ms slices with a bare yield between them
  (runnable throughout); ``block`` one W ms step; ``await_`` a tiny step, a
  D s await, a tiny step; ``stream`` a tiny step then N chunks G ms apart;
  ``upload`` a tiny step, T s waiting for the body, a tiny step.
* **the kernel**: new connections wait in the accept queue, keep-alive
  requests in socket buffers, both unseen until the loop's I/O phase.  With
  ``close_when_overloaded`` a request sent while the worker is shedding
  comes on a new connection (its previous answer said ``Connection: close``).
* **the sentinel**: while the loop is inside one long step it wakes every
  1 ms, waits ``U(0, gil_s)`` for the GIL, asks ``gate.stall_excess`` and
  answers that many of the oldest queued connections (each costing
  ``shed_cpu_s`` of the loop's CPU).
* **clients** give up after ``timeout_s``; a request whose client left is
  skipped when the loop reads it (``gone`` in the result), one already
  running is finished (its CPU is "wasted").

Virtual clock, seeded RNG, no threads.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field

from numaserve.loops.admission import AdmissionSettings, Reject
from numaserve.loops.cpu_gate import CpuGate

TINY = 0.0001       # CPU of a trivial step (parse, respond, one chunk)


@dataclass(frozen=True)
class Kind:
    """One traffic class: arrival rate (per second) during [start, end) and its shape."""

    name: str
    rate: float
    shape: str = "coop"           # coop | block | await_ | stream | upload
    work_s: float = 0.020
    slice_s: float = 0.005
    wait_s: float = 1.0           # await_: the await; upload: the body's arrival time
    chunks: int = 20
    gap_s: float = 0.05
    start: float = 0.0
    end: float | None = None

    def steps(self) -> list[tuple[float, float | None]]:
        """(CPU seconds, then await seconds or None for "ready again at once")."""
        if self.shape == "coop":
            n = max(1, round(self.work_s / self.slice_s))
            return [(self.work_s / n, None)] * n
        if self.shape == "block":
            return [(self.work_s, None)]
        if self.shape in ("await_", "upload"):
            return [(TINY, self.wait_s), (TINY, None)]
        if self.shape == "stream":
            return [(TINY, self.gap_s)] * self.chunks + [(TINY, None)]
        raise ValueError(self.shape)


@dataclass
class LoopSimConfig:
    kinds: list[Kind]
    duration_s: float = 20.0
    measure: tuple[float, float] = (5.0, 20.0)
    timeout_s: float = 2.0
    keepalive: bool = True
    seed: int = 1
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    gate: bool = True             # False: admit everything (the peers)
    sentinel: bool = True
    gil_s: float = 0.005          # sys.getswitchinterval()
    shed_cpu_s: float = 0.00005
    reject_cpu_s: float = 0.00005


@dataclass
class KindResult:
    arrivals: int = 0
    ok: int = 0
    shed: int = 0
    timeouts: int = 0
    gone: int = 0
    latencies: list[float] = field(default_factory=list)


@dataclass
class LoopSimResult:
    kinds: dict[str, KindResult]
    shed_latencies: list[float]
    sentinel_sheds: int
    wasted_cpu_s: float            # CPU spent on requests whose client had already given up
    busy_s: float                  # CPU the loop spent on request steps in the measure window
    length_s: float
    lags: list[float]

    def p(self, name: str, q: float) -> float:
        lat = sorted(self.kinds[name].latencies)
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")

    def shed_p(self, q: float) -> float:
        s = sorted(self.shed_latencies)
        return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


class _Req:
    __slots__ = ("arrival", "cpu", "i", "kind", "measured", "new_conn", "permit", "steps")

    def __init__(self, kind: Kind, arrival: float, new_conn: bool, measured: bool) -> None:
        self.kind = kind
        self.arrival = arrival
        self.steps = kind.steps()
        self.i = 0
        self.permit = None
        self.cpu = 0.0
        self.new_conn = new_conn
        self.measured = measured


def simulate_loop(cfg: LoopSimConfig) -> LoopSimResult:
    rng = random.Random(cfg.seed)
    gate = CpuGate(cfg.admission, 0.0, rng=random.Random(cfg.seed + 7))
    m0, m1 = cfg.measure
    res = {k.name: KindResult() for k in cfg.kinds}
    shed_lat: list[float] = []
    lags: list[float] = []
    # Arrivals, merged and sorted.
    arrivals: list[tuple[float, int, Kind]] = []
    for ki, k in enumerate(cfg.kinds):
        end = cfg.duration_s if k.end is None else k.end
        t = k.start
        while k.rate > 0:
            t += rng.expovariate(k.rate)
            if t >= end:
                break
            arrivals.append((t, ki, k))
    arrivals.sort()
    ai = 0
    accept_q: deque[_Req] = deque()
    buffers: deque[_Req] = deque()
    ready: deque[_Req] = deque()
    timers: list[tuple[float, int, object]] = []   # (due, seq, req or "probe")
    seq = 0
    now = 0.0
    probe_due: float | None = None
    beat = 0.0
    wasted = 0.0
    busy = 0.0
    sentinel_sheds = 0
    cpu_total = 0.0

    def arm(t: float, obj: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(timers, (t, seq, obj))

    def take_arrivals(until: float) -> None:
        nonlocal ai
        while ai < len(arrivals) and arrivals[ai][0] <= until:
            t, _, k = arrivals[ai]
            ai += 1
            new = (not cfg.keepalive) or (cfg.admission.close_when_overloaded and gate.shedding(t))
            r = _Req(k, t, new, m0 <= t < m1)
            res[k.name].arrivals += r.measured
            (accept_q if new else buffers).append(r)

    def answer_shed(r: _Req, t: float) -> None:
        if r.measured:
            res[r.kind.name].shed += 1
            shed_lat.append(t - r.arrival)

    def finish(r: _Req, t: float) -> None:
        kr = res[r.kind.name]
        late = t - r.arrival > cfg.timeout_s
        if r.measured:
            if late:
                kr.timeouts += 1
            else:
                kr.ok += 1
                kr.latencies.append(t - r.arrival)
        if r.permit is not None:
            gate.release(t, r.permit, "ok")

    def runnable_count() -> tuple[int, int]:
        started = sum(1 for r in ready if r.i > 0)
        return started, len(ready) - started

    def ensure_probe(t: float) -> None:
        nonlocal probe_due
        if probe_due is None:
            probe_due = t + gate.probe_delay()
            arm(probe_due, "probe")

    while True:
        # 1. timers
        while timers and timers[0][0] <= now:
            due, _, obj = heapq.heappop(timers)
            if obj == "probe":
                lag = now - due
                gate.on_lag(now, lag)
                lags.append(lag)
                gate.on_cpu(now, cpu_total, cpu_total)
                beat = now
                probe_due = None
                if gate.probe_wanted():   # as LoopProbe re-arms
                    ensure_probe(now)
            else:
                ready.append(obj)  # type: ignore[arg-type]
        # 2. ready phase: the tasks ready at its start, one step each
        for _ in range(len(ready)):
            r = ready.popleft()
            cpu, wait = r.steps[r.i]
            t0 = now
            end = now + cpu
            if cfg.sentinel and cfg.gate and cfg.admission.sentinel and cpu > 0.001:
                end = _sentinel_during(cfg, gate, rng, accept_q, take_arrivals, t0, end, beat, answer_shed,
                                       counter := [0])
                sentinel_sheds += counter[0]
            now = end
            r.cpu += cpu
            cpu_total += cpu
            if m0 <= t0 < m1:
                busy += cpu
            if t0 - r.arrival > cfg.timeout_s:
                wasted += cpu
            r.i += 1
            if r.i >= len(r.steps):
                finish(r, now)
            elif wait is None:
                ready.append(r)
            else:
                arm(now + wait, r)
        # 3. I/O phase
        take_arrivals(now)
        incoming = list(accept_q) + list(buffers)
        accept_q.clear()
        buffers.clear()
        for r in incoming:
            waited = now - r.arrival
            if waited > cfg.timeout_s:            # the client left: the loop reads its FIN, skips it
                if r.measured:
                    res[r.kind.name].gone += 1
                continue
            if not cfg.gate:
                ready.append(r)
                continue
            d = gate.try_admit(now, runnable=runnable_count)
            if isinstance(d, Reject):
                now += cfg.reject_cpu_s
                answer_shed(r, now)
            else:
                r.permit = d.permit
                ready.append(r)
                ensure_probe(now)
        # 4. sleep
        if not ready:
            nxt = [timers[0][0]] if timers else []
            if ai < len(arrivals):
                nxt.append(arrivals[ai][0])
            if not nxt:
                break
            now = max(now, min(nxt))
        if now > cfg.duration_s + cfg.timeout_s + 5:
            break
    return LoopSimResult(kinds=res, shed_latencies=shed_lat, sentinel_sheds=sentinel_sheds, wasted_cpu_s=wasted,
                         busy_s=busy, length_s=m1 - m0, lags=lags)


def _sentinel_during(cfg: LoopSimConfig, gate: CpuGate, rng: random.Random, accept_q: deque, take_arrivals,
                     t0: float, end: float, beat: float, answer_shed, counter: list[int]) -> float:
    """The sentinel thread while the loop runs one step from t0 to end; returns the (extended) end."""
    t = t0 + 0.001
    period = gate.probe_delay()
    while t < end:
        tg = t + rng.uniform(0, cfg.gil_s)      # the GIL, from a thread running Python
        if tg >= end:
            break
        take_arrivals(tg)
        n = gate.stall_excess(tg, tg - beat - period, len(accept_q))
        for _ in range(n):
            r = accept_q.popleft()
            end += cfg.shed_cpu_s
            tg += cfg.shed_cpu_s
            answer_shed(r, tg)
            counter[0] += 1
        if n:
            gate.record_stall_shed(tg, n)
        t = tg + 0.001
    return end
