"""Prometheus metrics of the supervisor, built from its status snapshot.

A custom ``Collector`` over a snapshot function (``Supervisor.status()`` plus
what the admin server adds, e.g. the loop heartbeat age), so the exposition
is a pure function of a dict: testable on a recorded snapshot, no processes.

Rules:
* labels are ``slot`` and ``node`` (plus small fixed vocabularies: status
  class, restart reason, state); never pid or generation, so a restart does
  not create new series;
* counters come from the slot ``totals`` (summed over worker generations), and
  a per-series high-water mark keeps them monotonic even when the snapshot
  dips for a moment (a retiring worker's counts are only folded into the
  totals when it is reaped);
* optional data (admission, limits, PSS, leak, remote memory, locality, IRQ)
  produces its metric only when present; malformed data omits that section
  and counts ``numaserve_metrics_errors_total``, it never raises.
"""

from __future__ import annotations

import math
import platform
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from numaserve import __version__
from numaserve.supervisor import slots as S
from numaserve.supervisor.readiness import unready_slots
from numaserve.worker.stats import BUCKET_UPPER_MS

__all__ = [
    "LEAK_VERDICTS",
    "RESTART_REASONS",
    "SLOT_STATES",
    "STANDARD_BUCKETS_MS",
    "NumaserveCollector",
    "make_registry",
    "rebucket",
    "unready_slots",
]

log = structlog.get_logger("numaserve.metrics")

SnapshotFn = Callable[[], Mapping[str, Any]]

#: Histogram bounds exported (ms; exposed as seconds).
STANDARD_BUCKETS_MS: tuple[float, ...] = (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)

SLOT_STATES: tuple[str, ...] = (S.STARTING, S.LOADING, S.READY, S.BACKOFF, S.FAILED, S.STOPPING, S.STOPPED,
                                S.DRAINING, S.DRAINED)
SUPERVISOR_STATES: tuple[str, ...] = ("starting", "running", "degraded", "failed", "stopping")
#: ``slots.restart_reason_class`` vocabulary, pre-initialised to 0 so the first restart is a visible increase.
RESTART_REASONS: tuple[str, ...] = ("hung", "not_ready", "sigkill", "sigabrt", "sigsegv", "app_failed",
                                    "spawn_failed", "binding", "leak", "soft_cap", "hard_cap", "reload",
                                    "restart", "exit", "other", "max_requests", "max_lifetime")
#: ``supervisor.exits`` kinds, pre-initialised like the reasons.
EXIT_KINDS: tuple[str, ...] = ("external", "crash", "boot", "hang")
STATUS_CLASSES: tuple[str, ...] = ("2xx", "3xx", "4xx", "5xx")
LEAK_VERDICTS: tuple[str, ...] = ("ok", "warming", "suspect", "leak", "soft_cap", "hard_cap")
STEERING_MODES: tuple[str, ...] = ("hash", "numa")
#: ``placement.repair`` actions, pre-initialised to 0 so the first repair is a visible increase.
LOCALITY_REPAIRS: tuple[str, ...] = ("migrate", "recycle")

SLOT_LABELS = ["slot", "node"]


# ----------------------------------------------------------------- helpers


def _num(v: Any) -> float | None:
    """A finite number, or None (bools, strings, NaN and None are not data)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _get(d: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(d, Mapping):
            return None
        d = d.get(key)
    return d


def _first(d: Mapping[str, Any], *paths: tuple[str, ...]) -> float | None:
    """The first numeric value found at any of ``paths`` (accepted spellings of optional data)."""
    for p in paths:
        v = _num(_get(d, *p))
        if v is not None:
            return v
    return None


def _slot_labels(s: Mapping[str, Any]) -> list[str]:
    return [str(s.get("slot")), str(s.get("node"))]


def rebucket(fine_counts: Sequence[float], targets_ms: Sequence[float] = STANDARD_BUCKETS_MS,
             fine_upper_ms: Sequence[float] = BUCKET_UPPER_MS) -> list[float]:
    """Cumulative counts ``<= target`` from per-bucket counts on the worker's fine log buckets.

    A fine bucket counts toward a target only when its whole range is below it
    (its upper bound <= target), so ``le`` never claims a request was faster
    than it may have been; the error is under one fine bucket (~19 %).
    """
    out: list[float] = []
    cum = 0.0
    i = 0
    n = min(len(fine_counts), len(fine_upper_ms))
    for t in targets_ms:
        while i < n and fine_upper_ms[i] <= t * (1 + 1e-9):
            cum += fine_counts[i]
            i += 1
        out.append(cum)
    return out


class _HighWater:
    """Per-series high-water marks: a counter never goes down while we run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, tuple[str, ...]], float] = {}
        self._hists: dict[tuple[str, tuple[str, ...]], tuple[list[float], float]] = {}

    def counter(self, name: str, labels: Sequence[str], value: float) -> float:
        key = (name, tuple(labels))
        with self._lock:
            v = max(value, self._counters.get(key, 0.0))
            self._counters[key] = v
        return v

    def histogram(self, name: str, labels: Sequence[str], cum: list[float], total_sum: float) -> tuple[list[float], float]:
        """Keep the last histogram whole when any bucket of the new one went down."""
        key = (name, tuple(labels))
        with self._lock:
            prev = self._hists.get(key)
            if prev is not None and (len(prev[0]) != len(cum) or any(a < b for a, b in zip(cum, prev[0]))):
                return prev
            self._hists[key] = (cum, total_sum)
        return cum, total_sum


class _Builder:
    """Collects metric families for one scrape."""

    def __init__(self, hw: _HighWater, snap: Mapping[str, Any]) -> None:
        self.hw = hw
        self.snap = snap
        self.families: dict[str, Metric] = {}

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> GaugeMetricFamily:
        fam = self.families.get(name)
        if fam is None:
            fam = self.families[name] = GaugeMetricFamily(name, doc, labels=list(labels))
        return fam  # type: ignore[return-value]

    def set(self, name: str, doc: str, labels: Sequence[str], values: Sequence[str], value: float | None) -> None:
        fam = self.gauge(name, doc, labels)
        if value is not None:
            fam.add_metric(list(values), value)

    def counter_family(self, name: str, doc: str, labels: Sequence[str] = ()) -> CounterMetricFamily:
        fam = self.families.get(name)
        if fam is None:
            fam = self.families[name] = CounterMetricFamily(name, doc, labels=list(labels))
        return fam  # type: ignore[return-value]

    def count(self, name: str, doc: str, labels: Sequence[str], values: Sequence[str], value: float | None) -> None:
        """Counter sample (``name`` ends in ``_total``), clamped to its high-water mark."""
        fam = self.counter_family(name, doc, labels)
        if value is not None:
            fam.add_metric(list(values), self.hw.counter(name, values, value))  # type: ignore[attr-defined]

    def histogram(self, name: str, doc: str, labels: Sequence[str], values: Sequence[str],
                  cum: list[float], total_sum: float, bounds_s: Sequence[float]) -> None:
        fam = self.families.get(name)
        if fam is None:
            fam = self.families[name] = HistogramMetricFamily(name, doc, labels=list(labels))
        cum, total_sum = self.hw.histogram(name, values, cum, total_sum)
        buckets = [(floatToGoString(b), c) for b, c in zip(bounds_s, cum[:-1])] + [("+Inf", cum[-1])]
        fam.add_metric(list(values), buckets, total_sum)  # type: ignore[attr-defined]

    def one_hot(self, name: str, doc: str, labels: Sequence[str], values: Sequence[str], key: str,
                vocabulary: Iterable[str], current: str | None) -> None:
        """One series per known value, 1 for the current one (unknown current values are added)."""
        vocab = list(vocabulary)
        if current is not None and current not in vocab:
            vocab.append(current)
        fam = self.gauge(name, doc, list(labels) + [key])
        for v in vocab:
            fam.add_metric(list(values) + [v], 1.0 if v == current else 0.0)


# -------------------------------------------------------------- collector


class NumaserveCollector(Collector):
    """prometheus_client collector over ``snapshot()`` (see the module docstring).

    ``cpu_node`` (CPU → node) is optional and only used to report on which
    node each steered IRQ lands.
    """

    def __init__(self, snapshot: SnapshotFn, *, cpu_node: Mapping[int, int] | None = None,
                 version: str = __version__) -> None:
        self.snapshot = snapshot
        self.cpu_node = dict(cpu_node or {})
        self.version = version
        self.errors = 0
        self._hw = _HighWater()
        self._ops_seen: dict[str, str] = {}          # finished operation id -> "kind/state"
        self._ops_counts: dict[tuple[str, str], int] = {}

    def describe(self) -> list[Metric]:
        """Nothing up front: names depend on the data (registering must not take a snapshot)."""
        return []

    def collect(self) -> Iterator[Metric]:
        b = _Builder(self._hw, {})
        b.set("numaserve_build_info", "numaserve version and Python (always 1)", ["version", "python"],
              [self.version, platform.python_version()], 1.0)
        try:
            snap = self.snapshot()
        except Exception as e:  # the supervisor is not in a state to report: say so, do not 500
            self.errors += 1
            log.warning("metrics_snapshot_failed", error=repr(e))
            snap = {}
        if not isinstance(snap, Mapping):
            snap = {}
        b.snap = snap
        sections: list[Callable[[_Builder, Mapping[str, Any]], None]] = [
            self._supervisor, self._operations, self._steering, self._irq, self._accept_queue, self._templates,
            self._locality_cost,
        ]
        for fn in sections:
            self._guard(fn, b, snap)
        for s in snap.get("slots") or []:
            if isinstance(s, Mapping):
                for fn in (self._slot_basic, self._slot_requests, self._slot_admission, self._slot_limits,
                           self._slot_memory, self._slot_leak, self._slot_locality):
                    self._guard(fn, b, s)
        self._guard(self._node_locality, b, snap)
        b.count("numaserve_metrics_errors_total", "Snapshot sections that could not be turned into metrics",
                [], [], float(self.errors))
        yield from (f for f in b.families.values() if f.samples)  # absent data: no empty family

    def _guard(self, fn: Callable[[_Builder, Mapping[str, Any]], None], b: _Builder, data: Mapping[str, Any]) -> None:
        try:
            fn(b, data)
        except Exception as e:
            self.errors += 1
            log.warning("metrics_section_failed", section=fn.__name__, error=repr(e))

    # -- supervisor ---------------------------------------------------------

    def _supervisor(self, b: _Builder, snap: Mapping[str, Any]) -> None:
        sup = snap.get("supervisor")
        if not isinstance(sup, Mapping):
            return
        b.set("numaserve_supervisor_uptime_seconds", "Seconds since the supervisor started", [], [],
              _num(sup.get("uptime_s")))
        state = sup.get("state")
        if isinstance(state, str):
            b.one_hot("numaserve_supervisor_state", "Supervisor state (1 for the current one)", [], [], "state",
                      SUPERVISOR_STATES, state)
            ready = state in ("running", "degraded") and not unready_slots(snap)
            b.set("numaserve_supervisor_ready", "1 when every non-drained slot is ready (as /readyz)", [], [],
                  1.0 if ready else 0.0)
        b.count("numaserve_bad_control_messages_total", "Malformed or unexpected control/ops messages dropped",
                [], [], _num(sup.get("bad_messages")))
        b.set("numaserve_supervisor_loop_heartbeat_age_seconds",
              "Seconds since the supervision loop last completed a tick", [], [],
              _num(sup.get("loop_heartbeat_age_s")))
        fds = _get(sup, "control_plane", "fds")
        if isinstance(fds, Mapping):
            b.set("numaserve_supervisor_open_fds", "File descriptors the supervisor holds", [], [],
                  _num(fds.get("open")))
            b.set("numaserve_supervisor_fd_limit", "The supervisor's open-file limit (soft RLIMIT_NOFILE)", [], [],
                  _num(fds.get("limit")))
            b.count("numaserve_supervisor_fd_exhausted_total", "Seconds in which a supervisor call failed with "
                    "EMFILE/ENFILE", [], [], _num(fds.get("exhausted")))
        limited = _get(sup, "control_plane", "ops_rate_limited")
        if limited is not None:
            b.count("numaserve_ops_rate_limited_total", "Ops requests answered \"rate limited\"", [], [],
                    _num(limited))

    def _templates(self, b: _Builder, snap: Mapping[str, Any]) -> None:
        for t in _get(snap, "templates", "nodes") or []:
            if not isinstance(t, Mapping):
                continue
            node = [str(t.get("node"))]
            b.set("numaserve_template_ready", "1 when the node's warm template forks workers", ["node"], node,
                  1.0 if t.get("state") == "ready" else 0.0)
            b.set("numaserve_template_generation", "Generation of the node's warm template", ["node"], node,
                  _num(t.get("generation")))
            b.count("numaserve_template_restarts_total", "Warm template respawns after it died", ["node"], node,
                    _num(t.get("restarts")))
            mem = t.get("memory") if isinstance(t.get("memory"), Mapping) else {}
            for key in ("pss", "shared", "private"):
                b.set(f"numaserve_template_{key}_bytes", f"{key.upper() if key == 'pss' else key.capitalize()} "
                      "memory of the node's warm template (smaps_rollup)", ["node"], node, _num(mem.get(f"{key}_bytes")))

    def _operations(self, b: _Builder, snap: Mapping[str, Any]) -> None:
        ops = snap.get("operations")
        if not isinstance(ops, list):
            return
        running = 0
        listed: set[str] = set()
        for o in ops:
            if not isinstance(o, Mapping):
                continue
            oid, kind, state = str(o.get("id")), str(o.get("kind")), str(o.get("state"))
            listed.add(oid)
            if state == "running":
                running += 1
            elif oid not in self._ops_seen:
                self._ops_seen[oid] = state
                self._ops_counts[(kind, state)] = self._ops_counts.get((kind, state), 0) + 1
        # forget ids that fell out of the (bounded) recent list: they cannot come back
        for oid in [k for k in self._ops_seen if k not in listed]:
            del self._ops_seen[oid]
        b.set("numaserve_operations_running", "Operations (reload, drain, ...) in progress", [], [], float(running))
        b.counter_family("numaserve_operations_total", "Finished operations by kind and result", ["kind", "result"])
        for (kind, state), n in sorted(self._ops_counts.items()):
            b.count("numaserve_operations_total", "", ["kind", "result"], [kind, state], float(n))

    def _steering(self, b: _Builder, snap: Mapping[str, Any]) -> None:
        st = _get(snap, "supervisor", "steering")
        if not isinstance(st, Mapping):
            return
        attached = st.get("program_attached")
        if isinstance(attached, bool):
            b.set("numaserve_steering_program_attached", "1 when a reuseport selection program is attached",
                  [], [], 1.0 if attached else 0.0)
        mode = st.get("mode")
        if isinstance(mode, str):
            b.one_hot("numaserve_steering_mode", "Connection steering mode (1 for the current one)", [], [], "mode",
                      STEERING_MODES, mode)
        healthy = st.get("healthy_slots")
        if isinstance(healthy, list):
            b.set("numaserve_steering_healthy_slots", "Slots the steering program sends new connections to",
                  [], [], float(len(healthy)))
        b.count("numaserve_steering_updates_total", "Steering program re-attachments", [], [], _num(st.get("updates")))
        b.count("numaserve_steering_errors_total", "Steering program attach failures", [], [], _num(st.get("errors")))
        overall = _first(st, ("locality_share",), ("locality", "share"))
        b.set("numaserve_steering_overall_locality_ratio",
              "Share of connections accepted on the node of the CPU that received them", [], [], overall)

    def _irq(self, b: _Builder, snap: Mapping[str, Any]) -> None:
        irq = _get(snap, "supervisor", "irq")
        if not isinstance(irq, Mapping):
            return
        applied = irq.get("applied")
        if isinstance(applied, bool):
            b.set("numaserve_irq_steering_applied", "1 when NIC IRQ steering was applied at start", [], [],
                  1.0 if applied else 0.0)
        b.set("numaserve_irq_steered_irqs", "NIC queue IRQs steered at start", [], [], _num(irq.get("irqs")))
        failed = irq.get("failed")
        if isinstance(failed, list):
            by: dict[str, int] = {}
            for f in failed:
                st = str(f.get("status", "failed")) if isinstance(f, Mapping) else "failed"
                by[st] = by.get(st, 0) + 1
            fam = b.gauge("numaserve_irq_failed_irqs", "NIC queue IRQs that could not be steered, by status",
                          ["status"])
            for st, n in sorted(by.items()):
                fam.add_metric([st], float(n))
        placement = irq.get("placement")
        if isinstance(placement, Mapping) and self.cpu_node:
            per_node: dict[str, int] = {}
            for cpus in placement.values():
                if not isinstance(cpus, list):
                    continue
                nodes = {self.cpu_node.get(c) for c in cpus if isinstance(c, int)} - {None}
                key = str(nodes.pop()) if len(nodes) == 1 else ("mixed" if nodes else "unknown")
                per_node[key] = per_node.get(key, 0) + 1
            fam = b.gauge("numaserve_irq_placement_irqs", "Steered NIC queue IRQs by the node of their target CPUs",
                          ["node"])
            for node, n in sorted(per_node.items()):
                fam.add_metric([node], float(n))

    def _accept_queue(self, b: _Builder, snap: Mapping[str, Any]) -> None:
        aq = _get(snap, "supervisor", "accept_queue")
        if not isinstance(aq, Mapping):
            return
        addresses = _get(snap, "supervisor", "listeners") or []
        nodes = {str(s.get("slot")): str(s.get("node")) for s in snap.get("slots") or [] if isinstance(s, Mapping)}
        fam = b.gauge("numaserve_accept_queue_depth",
                      "Connections waiting in a slot listener's accept queue", ["slot", "node", "address"])
        for slot, depths in aq.items():
            if not isinstance(depths, list):
                continue
            for i, d in enumerate(depths):
                v = _num(d)
                if v is None:
                    continue
                addr = str(addresses[i]) if isinstance(addresses, list) and i < len(addresses) else str(i)
                fam.add_metric([str(slot), nodes.get(str(slot), ""), addr], v)

    # -- per slot -------------------------------------------------------------

    def _slot_basic(self, b: _Builder, s: Mapping[str, Any]) -> None:
        lv = _slot_labels(s)
        state = s.get("state")
        b.one_hot("numaserve_slot_state", "Slot state (1 for the current one)", SLOT_LABELS, lv, "state",
                  SLOT_STATES, state if isinstance(state, str) else None)
        bv = s.get("binding_verified")
        if isinstance(bv, bool):
            b.set("numaserve_binding_verified", "1 when the worker's CPU/memory binding was verified from outside",
                  SLOT_LABELS, lv, 1.0 if bv else 0.0)
        restarts = _get(s, "totals", "restarts_by_reason")
        restarts = restarts if isinstance(restarts, Mapping) else {}
        for reason in sorted(set(RESTART_REASONS) | {str(k) for k in restarts}):
            b.count("numaserve_worker_restarts_total", "Worker restarts by reason class", SLOT_LABELS + ["reason"],
                    lv + [reason], _num(restarts.get(reason)) or 0.0)
        kinds = _get(s, "totals", "exits_by_kind")
        kinds = kinds if isinstance(kinds, Mapping) else {}
        for kind in sorted(set(EXIT_KINDS) | {str(k) for k in kinds}):
            b.count("numaserve_worker_exits_total",
                    "Unexpected worker exits by kind (external: killed from outside while serving, not held "
                    "against the slot; crash, boot, hang: count towards its crash loop)",
                    SLOT_LABELS + ["kind"], lv + [kind], _num(kinds.get(kind)) or 0.0)
        b.set("numaserve_worker_loop_lag_seconds", "Event-loop lag the worker reported in its last heartbeat",
              SLOT_LABELS, lv, _num(s.get("loop_lag_s")))

    def _slot_requests(self, b: _Builder, s: Mapping[str, Any]) -> None:
        lv = _slot_labels(s)
        totals = s.get("totals") if isinstance(s.get("totals"), Mapping) else {}
        classes = totals.get("status_classes")
        if not isinstance(classes, Mapping):
            classes = s.get("status_classes") if isinstance(s.get("status_classes"), Mapping) else {}
        for cls in sorted(set(STATUS_CLASSES) | {str(k) for k in classes}):
            b.count("numaserve_requests_total", "Completed requests by HTTP status class",
                    SLOT_LABELS + ["status_class"], lv + [cls], _num(classes.get(cls)) or 0.0)
        fine = totals.get("latency_buckets")
        fine = [(_num(x) or 0.0) for x in fine] if isinstance(fine, list) else []
        cum = rebucket(fine) + [float(sum(fine))]
        total_sum = (_num(totals.get("latency_sum_ms")) or 0.0) / 1000.0
        b.histogram("numaserve_request_duration_seconds", "Request latency (handler start to response end)",
                    SLOT_LABELS, lv, cum, total_sum, [ms / 1000.0 for ms in STANDARD_BUCKETS_MS])
        b.set("numaserve_inflight_requests", "Requests being handled now", SLOT_LABELS, lv,
              _num(s.get("inflight")) or 0.0)
        b.set("numaserve_open_connections", "Client connections open in the worker", SLOT_LABELS, lv,
              _num(s.get("connections")) or 0.0)
        conns = totals.get("connections")
        if isinstance(conns, Mapping):
            for loc in sorted({"local", "remote", "unknown"} | {str(k) for k in conns}):
                b.count("numaserve_accepted_connections_total",
                        "Accepted connections by whether the receiving CPU was on the slot's node (SO_INCOMING_CPU)",
                        SLOT_LABELS + ["locality"], lv + [loc], _num(conns.get(loc)) or 0.0)

    def _slot_admission(self, b: _Builder, s: Mapping[str, Any]) -> None:
        """Worker admission gate: top-level ``queued``/``shed`` and the ``admission`` dict
        (the worker's gate snapshot); cumulative shed counts preferably from ``totals``."""
        lv = _slot_labels(s)
        adm = s.get("admission") if isinstance(s.get("admission"), Mapping) else {}
        b.set("numaserve_queued_requests", "Requests waiting for admission in the worker", SLOT_LABELS, lv,
              _first(s, ("queued",), ("admission", "queued")) or 0.0)
        totals = s.get("totals") if isinstance(s.get("totals"), Mapping) else {}
        by_reason = next((d for d in (totals.get("shed_by_reason"), adm.get("shed"), s.get("shed"), totals.get("shed"))
                          if isinstance(d, Mapping)), None)
        total = _first(totals, ("shed",))
        if total is None:
            total = _num(s.get("shed"))
        if total is None and by_reason is not None:
            total = sum(_num(v) or 0.0 for v in by_reason.values())
        b.count("numaserve_shed_requests_total", "Requests refused by admission control (503/504/429)",
                SLOT_LABELS, lv, total or 0.0)
        if by_reason:
            for reason, v in sorted(by_reason.items()):
                b.count("numaserve_shed_requests_by_reason_total", "Requests refused by admission control, by reason",
                        SLOT_LABELS + ["reason"], lv + [str(reason)], _num(v))
        b.set("numaserve_admission_limit", "Effective in-flight limit of the worker's admission gate",
              SLOT_LABELS, lv, _first(s, ("admission", "limit"), ("limits", "effective_limit")))
        overloaded = adm.get("codel_overloaded")
        if isinstance(overloaded, bool):
            b.set("numaserve_admission_overloaded", "1 while the worker's loop is overloaded (busy without an idle moment)",
                  SLOT_LABELS, lv, 1.0 if overloaded else 0.0)

    def _slot_limits(self, b: _Builder, s: Mapping[str, Any]) -> None:
        """Pushed limits: the supervisor's ``limits`` dict when present, else what the
        worker's gate reports it applies.  No ceiling / rate <= 0 (unlimited) = absent."""
        lv = _slot_labels(s)
        lim = s.get("limits") if isinstance(s.get("limits"), Mapping) else {}
        adm = s.get("admission") if isinstance(s.get("admission"), Mapping) else {}

        def pick(key: str, adm_key: str) -> float | None:
            return _num(lim.get(key)) if key in lim else _num(adm.get(adm_key))

        b.set("numaserve_limit_concurrency", "Concurrency ceiling pushed to the worker", SLOT_LABELS, lv,
              pick("concurrency", "ceiling"))
        rate = pick("rate", "rate")
        if rate is not None and rate > 0:
            b.set("numaserve_limit_rate_requests_per_second", "Request rate quota pushed to the worker",
                  SLOT_LABELS, lv, rate)
            b.set("numaserve_limit_burst_requests", "Rate quota burst pushed to the worker", SLOT_LABELS, lv,
                  pick("burst", "burst"))
        b.set("numaserve_limits_epoch", "Epoch of the limits pushed to the slot", SLOT_LABELS, lv,
              _num(lim.get("epoch")))
        applied = _first(s, ("limits", "applied_epoch"), ("limits_epoch",), ("admission", "epoch"))
        if applied is not None:
            b.set("numaserve_limits_applied_epoch", "Limits epoch the worker acknowledged", SLOT_LABELS, lv, applied)

    def _slot_memory(self, b: _Builder, s: Mapping[str, Any]) -> None:
        lv = _slot_labels(s)
        b.set("numaserve_worker_rss_bytes", "Resident set size of the slot's worker", SLOT_LABELS, lv,
              _num(s.get("rss_bytes")) or 0.0)
        b.set("numaserve_worker_pss_bytes", "Proportional set size of the slot's worker", SLOT_LABELS, lv,
              _first(s, ("pss_bytes",), ("memory", "pss_bytes")))
        b.set("numaserve_worker_uss_bytes", "Unique set size of the slot's worker", SLOT_LABELS, lv,
              _first(s, ("uss_bytes",), ("memory", "uss_bytes")))
        b.set("numaserve_worker_remote_memory_ratio",
              "Share of the worker's resident memory on nodes outside its memory binding", SLOT_LABELS, lv,
              _first(s, ("remote_memory_share",), ("memory", "remote_share"), ("remote_share",)))
        locality = _first(s, ("steering_locality",), ("locality_share",), ("totals", "locality_share"))
        if locality is None:  # or per slot under supervisor.steering.locality_by_slot {slot: share}
            locality = _num(_get(b.snap, "supervisor", "steering", "locality_by_slot", str(s.get("slot"))))
        b.set("numaserve_steering_locality_ratio", "Share of a slot's connections received on its node",
              SLOT_LABELS, lv, locality)

    def _slot_leak(self, b: _Builder, s: Mapping[str, Any]) -> None:
        """Leak detector output: the slot's ``memory`` dict (leakwatch status) or a ``leak`` dict."""
        lv = _slot_labels(s)
        for key in ("leak", "memory"):
            leak = s.get(key)
            if not isinstance(leak, Mapping):
                continue
            per_1000 = _first(leak, ("slope_bytes_per_1000_requests",), ("slope_per_1000_requests",),
                              ("evidence", "slope_per_1000_requests"))
            b.set("numaserve_leak_slope_bytes_per_1000_requests", "Robust memory slope over the request window",
                  SLOT_LABELS, lv, per_1000)
            per_s = _first(leak, ("slope_bytes_per_second",))
            if per_s is None:
                per_min = _first(leak, ("slope_per_minute",), ("evidence", "slope_per_minute"))
                per_s = per_min / 60.0 if per_min is not None else None
            b.set("numaserve_leak_slope_bytes_per_second", "Robust memory slope over the time window",
                  SLOT_LABELS, lv, per_s)
            b.set("numaserve_leak_budget_bytes", "Per-worker memory budget the leak caps are fractions of",
                  SLOT_LABELS, lv, _num(leak.get("budget_bytes")) or None)
            verdict = leak.get("verdict", leak.get("kind"))
            if isinstance(verdict, str):
                b.one_hot("numaserve_leak_verdict", "Leak detector verdict (1 for the current one)", SLOT_LABELS,
                          lv, "verdict", LEAK_VERDICTS, verdict)
            return

    def _slot_locality(self, b: _Builder, s: Mapping[str, Any]) -> None:
        """The locality watch's last sample (``locality``) and its repairs, counted per action."""
        loc = s.get("locality")
        if not isinstance(loc, Mapping):
            return
        lv = _slot_labels(s)
        b.set("numaserve_worker_memory_local_ratio",
              "Share of the worker's anonymous memory (heap, stack, mappings) on its own node (numa_maps sample)", SLOT_LABELS, lv,
              _num(loc.get("local_ratio")))
        b.set("numaserve_worker_threads_off_node",
              "Worker threads whose last CPU was not one of its node's CPUs", SLOT_LABELS, lv,
              _num(loc.get("threads_off_node")))
        repairs = loc.get("repairs") if isinstance(loc.get("repairs"), Mapping) else {}
        for action in sorted(set(LOCALITY_REPAIRS) | {str(k) for k in repairs}):
            b.count("numaserve_locality_repairs_total", "Locality repairs by action (placement.repair)",
                    SLOT_LABELS + ["action"], lv + [action], _num(repairs.get(action)) or 0.0)

    def _locality_cost(self, b: _Builder, snap: Mapping[str, Any]) -> None:
        """The locality watch's own cost: samples taken and the CPU seconds they took."""
        cost = _get(snap, "supervisor", "locality")
        if not isinstance(cost, Mapping):
            return
        b.count("numaserve_locality_samples_total", "Locality samples taken (numa_maps + thread CPUs)", [], [],
                _num(cost.get("samples")))
        b.count("numaserve_locality_sample_cpu_seconds_total",
                "CPU time the locality samples took (budget: 1 % of one CPU)", [], [], _num(cost.get("cpu_s")))

    def _node_locality(self, b: _Builder, snap: Mapping[str, Any]) -> None:
        """Per node: the share of its workers' anonymous memory that sits on other nodes."""
        remote: dict[str, float] = {}
        total: dict[str, float] = {}
        for s in snap.get("slots") or []:
            loc = s.get("locality") if isinstance(s, Mapping) else None
            if not isinstance(loc, Mapping):
                continue
            r, t = _num(loc.get("remote_anon_bytes")), _num(loc.get("anon_bytes"))
            if r is None or not t:
                continue
            node = str(s.get("node"))
            remote[node] = remote.get(node, 0.0) + r
            total[node] = total.get(node, 0.0) + t
        for node in sorted(total):
            b.set("numaserve_node_memory_remote_ratio",
                  "Share of the node's workers' anonymous memory on other nodes", ["node"], [node],
                  remote[node] / total[node])


def make_registry(collector: Collector) -> Any:
    """A registry holding only ``collector`` (no process/platform/GC defaults: the
    supervisor's own Python internals are not what operators need)."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    return reg
