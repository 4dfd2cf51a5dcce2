"""Deterministic discrete-event simulation of one worker behind the L0/L1 gate (+ optional L2).

Model (FACTS-limits-leaks §8.1): M parallel servers with a FIFO in front
(the app's own semaphore), lognormal service (cv 0.5), Poisson arrivals in
phases, a client deadline (late = lost).  The gate's permit → finish time is
the "service time" L1 sees: it includes waiting for a server, which is
exactly the congestion signal.  Virtual clock, seeded RNGs, no threads.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from numaserve.loops.admission import Admit, AdmissionMachine, AdmissionSettings, Grant, Queued, Reject
from numaserve.loops.gradient import GradientController, GradientSettings
from numaserve.loops.supervisor_limits import LimitsLoop, LimitsSettings, NodeWindow, WorkerWindow


@dataclass
class SimConfig:
    servers: int = 4
    service_s: float = 0.020
    cv: float = 0.5
    timeout_s: float = 1.0
    phases: list[tuple[float, float]] = field(default_factory=lambda: [(20.0, 0.7), (60.0, 3.0), (30.0, 0.5)])
    measure: tuple[float, float] = (40.0, 80.0)
    seed: int = 1
    # policy: "gradient" (L1 + gate), "static" (gate with a fixed limit), "none" (no gate limit),
    # "vegas" (L2 Vegas rate, no concurrency limit)
    policy: str = "gradient"
    codel: bool = True
    static_limit: int = 64
    gradient: GradientSettings = field(default_factory=GradientSettings)
    admission: AdmissionSettings | None = None
    limits: LimitsSettings | None = None      # run the L2 loop with these settings
    vegas_scaled: bool = True
    vegas_signal: str = "total"
    tick_s: float = 0.01
    service_multiplier: list[tuple[float, float, float]] = field(default_factory=list)  # (start, end, ×)

    @property
    def capacity(self) -> float:
        return self.servers / self.service_s


@dataclass
class SimResult:
    capacity: float
    goodput: float                 # on-time successes completed in the measure window / (C × length)
    p50_admitted: float
    p99_admitted: float            # total latency of admitted, completed requests in the window
    shed_rate: float               # rejected + shed / arrivals in the window
    rejected_immediately: int
    shed_after_queue: int
    shed_wait_max: float
    shed_wait_p99: float
    limits: list[tuple[float, float]]      # (t, enforced limit) every tick
    baselines: list[tuple[float, float]]   # (t, L1 baseline)
    rates: list[tuple[float, float]]       # (t, vegas node rate)
    epochs: list[int]
    timeouts: int
    statuses: dict[int, int]
    probes: int


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class _Req:
    __slots__ = ("arrival", "deadline", "permit", "ticket")

    def __init__(self, arrival: float, deadline: float) -> None:
        self.arrival = arrival
        self.deadline = deadline
        self.permit = None
        self.ticket = None


def simulate(cfg: SimConfig) -> SimResult:
    rng_arr = random.Random(cfg.seed * 1000 + 1)
    rng_svc = random.Random(cfg.seed * 1000 + 2)
    rng_ctl = random.Random(cfg.seed * 1000 + 3)
    sigma = math.sqrt(math.log(1 + cfg.cv**2))
    mu = math.log(cfg.service_s) - sigma**2 / 2
    cap = cfg.capacity

    adm = cfg.admission or AdmissionSettings()
    if not cfg.codel:
        adm = AdmissionSettings(**{**_struct_dict(adm), "max_wait_factor": 0.0, "slough_factor": 1e9})
    controller = None
    if cfg.policy == "gradient":
        controller = GradientController(cfg.gradient, 0.0, rng=rng_ctl)
    elif cfg.policy == "static":
        adm = AdmissionSettings(**{**_struct_dict(adm), "static_limit": cfg.static_limit})
    gate = AdmissionMachine(adm, 0.0, controller=controller, rng=rng_ctl)
    if cfg.policy == "vegas":
        gate.set_baseline(cfg.service_s)

    l2: LimitsLoop | None = None
    if cfg.limits is not None or cfg.policy == "vegas":
        # the documents' rule as written: on total latency (FACTS-limits-leaks §8.1)
        ls = cfg.limits or LimitsSettings(mode="vegas", slo_guard=False, vegas_scaled=cfg.vegas_scaled,
                                          vegas_initial_rps=0.5 * cap, vegas_signal=cfg.vegas_signal)
        l2 = LimitsLoop(ls, 0.0)

    events: list[tuple[float, int, int, object]] = []
    seq = 0

    def push(t: float, kind: int, obj: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, obj))

    ARRIVAL, FINISH, TICK, L2, EXPIRE = 0, 1, 2, 3, 4
    busy = 0
    server_q: list[_Req] = []
    server_qi = 0
    by_ticket: dict[int, _Req] = {}

    m0, m1 = cfg.measure
    arrivals_in = 0
    good = 0
    lat_ok: list[float] = []
    shed_waits: list[float] = []
    rejected_now = 0
    shed_q = 0
    timeouts = 0
    statuses: dict[int, int] = {}
    limits: list[tuple[float, float]] = []
    baselines: list[tuple[float, float]] = []
    rates: list[tuple[float, float]] = []
    epochs: list[int] = []
    # L2 window accumulators
    w_completed = 0
    w_admitted = 0
    w_arrivals = 0
    w_lat: list[float] = []
    w_delay: list[float] = []              # server-side delay: arrival → permit (queue wait)
    w_max_inflight = 0

    ends = []
    t_acc = 0.0
    for dur, load in cfg.phases:
        ends.append((t_acc + dur, load))
        t_acc += dur
    horizon = t_acc

    def load_at(t: float) -> float:
        for end, load in ends:
            if t < end:
                return load
        return 0.0

    def svc_mult(t: float) -> float:
        for a, b, x in cfg.service_multiplier:
            if a <= t < b:
                return x
        return 1.0

    def start(req: _Req, now: float) -> None:
        nonlocal busy, w_max_inflight, w_admitted
        w_admitted += 1
        w_max_inflight = max(w_max_inflight, gate.inflight)
        if busy < cfg.servers:
            busy += 1
            push(now + rng_svc.lognormvariate(mu, sigma) * svc_mult(now), FINISH, req)
        else:
            server_q.append(req)

    def shed(req: _Req, status: int, now: float, queued: bool) -> None:
        nonlocal rejected_now, shed_q
        statuses[status] = statuses.get(status, 0) + 1
        if queued:
            shed_q += 1
            shed_waits.append(now - req.arrival)
        else:
            rejected_now += 1

    def apply(decisions: list, now: float) -> None:
        for d in decisions:
            req = by_ticket.pop(d.ticket.id)
            if isinstance(d, Grant):
                req.permit = d.permit
                start(req, now)
            else:
                shed(req, d.reject.status, now, queued=True)

    push(rng_arr.expovariate(max(1e-9, load_at(0.0) * cap)), ARRIVAL, None)
    push(cfg.tick_s, TICK, None)
    if l2 is not None:
        push(l2.s.interval_s, L2, None)

    while events:
        now, _, kind, obj = heapq.heappop(events)
        if now > horizon + 10.0:
            break
        if kind == ARRIVAL:
            if now < horizon:
                load = load_at(now)
                push(now + rng_arr.expovariate(load * cap) if load > 0 else horizon, ARRIVAL, None)
            else:
                continue
            req = _Req(now, now + cfg.timeout_s)
            w_arrivals += 1
            in_window = m0 <= now < m1
            arrivals_in += in_window
            d = gate.try_admit(now, req.deadline)
            if isinstance(d, Reject):
                shed(req, d.status, now, queued=False)
            elif isinstance(d, Admit):
                req.permit = d.permit
                start(req, now)
            else:
                assert isinstance(d, Queued)
                req.ticket = d.ticket
                by_ticket[d.ticket.id] = req
                if not math.isinf(d.ticket.expires_at):  # the wrapper's per-waiter timer
                    push(d.ticket.expires_at, EXPIRE, d.ticket)
                apply(gate.poll(now), now)
        elif kind == FINISH:
            req = obj  # type: ignore[assignment]
            if server_qi < len(server_q):
                nxt = server_q[server_qi]
                server_qi += 1
                if server_qi > 4096:
                    del server_q[:server_qi]
                    server_qi = 0
                push(now + rng_svc.lognormvariate(mu, sigma) * svc_mult(now), FINISH, nxt)
            else:
                busy -= 1
            late = now > req.deadline
            outcome = "dropped" if late else "ok"
            if late:
                timeouts += 1
            statuses[504 if late else 200] = statuses.get(504 if late else 200, 0) + 1
            if not late:
                w_completed += 1
                w_lat.append(now - req.arrival)
                w_delay.append(req.permit.granted_at - req.arrival)
                if m0 <= now < m1:
                    good += 1
                if m0 <= req.arrival < m1:
                    lat_ok.append(now - req.arrival)
            apply(gate.release(now, req.permit, outcome), now)
        elif kind == EXPIRE:
            apply(gate.poll(now), now)
        elif kind == TICK:
            apply(gate.poll(now), now)
            limits.append((now, float(min(gate.limit(now), 10_000))))
            if controller is not None and controller.baseline_s is not None:
                baselines.append((now, controller.baseline_s))
            if now + cfg.tick_s < horizon + 5.0:
                push(now + cfg.tick_s, TICK, None)
        elif kind == L2:
            assert l2 is not None
            lat_sorted = sorted(w_lat)
            win = NodeWindow(
                duration_s=l2.s.interval_s, completed=w_completed, admitted=w_admitted,
                p90_total_s=lat_sorted[int(0.9 * (len(lat_sorted) - 1))] if lat_sorted else None,
                mean_total_s=sum(lat_sorted) / len(lat_sorted) if lat_sorted else None,
                min_total_s=lat_sorted[0] if lat_sorted else None,
                p90_delay_s=_pct(w_delay, 0.9) if w_delay else None,
                mean_delay_s=sum(w_delay) / len(w_delay) if w_delay else None,
                min_delay_s=min(w_delay) if w_delay else None,
                workers=[WorkerWindow(slot=0, l1_limit=None if controller is None else controller.nominal_limit,
                                      max_inflight=w_max_inflight, queued=gate.queued, arrivals=w_arrivals,
                                      admitted=w_admitted, codel_overloaded=gate.codel.overloaded)],
            )
            dec = l2.update(now, win)
            if dec is not None:
                sl = dec.slots[0]
                gate.set_limits(now, dec.epoch, rate=sl.rate, burst=sl.burst, concurrency=sl.concurrency,
                                lease_expiry=sl.lease_expiry, safe_concurrency=sl.safe_concurrency)
                epochs.append(dec.epoch)
                if dec.node_rate is not None:
                    rates.append((now, dec.node_rate))
                apply(gate.poll(now), now)
            w_completed = w_admitted = w_arrivals = 0
            w_lat = []
            w_delay = []
            w_max_inflight = gate.inflight
            if now + l2.s.interval_s < horizon:
                push(now + l2.s.interval_s, L2, None)

    length = m1 - m0
    return SimResult(
        capacity=cap,
        goodput=good / (cap * length),
        p50_admitted=_pct(lat_ok, 0.5),
        p99_admitted=_pct(lat_ok, 0.99),
        shed_rate=0.0 if not arrivals_in else 1 - len(lat_ok) / arrivals_in,
        rejected_immediately=rejected_now,
        shed_after_queue=shed_q,
        shed_wait_max=max(shed_waits, default=0.0),
        shed_wait_p99=_pct(shed_waits, 0.99) if shed_waits else 0.0,
        limits=limits, baselines=baselines, rates=rates, epochs=epochs, timeouts=timeouts, statuses=statuses,
        probes=0 if controller is None else controller.probes,
    )


def _struct_dict(s: object) -> dict:
    import msgspec

    return msgspec.structs.asdict(s)  # type: ignore[arg-type]
