"""Supervisor metrics and admin app, from recorded snapshots (no processes)."""

from __future__ import annotations

import asyncio
import copy
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from numaserve.control.messages import Stats
from numaserve.bind.placement import SlotPlan
from numaserve.supervisor import slots as S
from numaserve.supervisor.admin import AdminConfig, LoopHeartbeat, build_app, open_admin_socket, start_admin
from numaserve.supervisor.backoff import RestartPolicy, RestartState
from numaserve.supervisor.metrics import (
    RESTART_REASONS,
    STANDARD_BUCKETS_MS,
    NumaserveCollector,
    make_registry,
    rebucket,
    unready_slots,
)
from numaserve.worker.stats import BUCKET_UPPER_MS, LatencyHistogram

REPO = Path(__file__).resolve().parents[2]
N_FINE = len(BUCKET_UPPER_MS)


def fine_buckets(*latencies_ms: float) -> list[int]:
    h = LatencyHistogram()
    for ms in latencies_ms:
        h.observe(ms)
    return list(h.counts)


def slot(i: int, node: int, *, state: str = "ready", lat: tuple[float, ...] = (0.5, 3.0, 40.0), **extra: Any) -> dict:
    """One slot as ``SlotState.status()`` reports it (recorded from a real run, trimmed)."""
    buckets = fine_buckets(*lat)
    s = {
        "slot": i, "node": node, "index": 0, "pid": 6235 + i, "generation": 3, "state": state,
        "cpus": [i], "mempolicy": "bind", "memory_nodes": [node], "gpus": [],
        "binding_verified": True, "binding_problems": [], "worker_placement": None,
        "rss_bytes": 43855872, "uptime_s": 5.6, "ready_s": 5.3, "restarts": 2,
        "last_restart_reason": "killed by SIGKILL", "last_exit": "killed by SIGKILL", "failed_reason": None,
        "requests": len(lat), "inflight": 1, "connections": 3,
        "latency_ms": {"p50": 3.0, "p90": 40.0, "p99": 40.0, "mean": 14.5, "max": 40.0},
        "status_classes": {"2xx": len(lat)},
        "totals": {"status_classes": {"2xx": len(lat) - 1, "5xx": 1}, "latency_buckets": buckets,
                   "latency_count": len(lat), "latency_sum_ms": sum(lat),
                   "restarts_by_reason": {"sigkill": 1, "reload": 1}},
        "loop_lag_s": 0.0048, "last_heartbeat_s": 0.3, "external": False, "drained": False,
        "incoming": None, "retiring": [], "operation": None,
    }
    s.update(extra)
    return s


def full_snapshot() -> dict[str, Any]:
    """Representative snapshot with every optional section present."""
    s0 = slot(0, 0, queued=4, shed=7, pss_bytes=30_000_000, uss_bytes=25_000_000, remote_memory_share=0.02,
              steering_locality=0.97, limits={"concurrency": 64, "rate": 500.0, "burst": 50.0, "epoch": 12},
              limits_epoch=12,
              admission={"limit": 32, "ceiling": 64, "rate": 500.0, "burst": 50.0, "epoch": 12, "queued": 4,
                         "shed": {"overload": 5, "deadline": 2}, "codel_overloaded": False},
              leak={"verdict": "suspect", "slope_bytes_per_1000_requests": 2.5e6, "slope_per_minute": 6.0e5})
    s0["totals"]["connections"] = {"local": 90, "remote": 10}
    s0["totals"]["locality_share"] = 0.9
    s0["locality"] = {"local_ratio": 0.97, "threads_off_node": 1, "anon_bytes": 40_000_000,
                      "remote_anon_bytes": 1_200_000, "repairs": {"migrate": 1}}
    # slot 1: no supervisor limits yet; the worker's gate says what it applies
    s1 = slot(1, 1, queued=0, shed=5,
              memory={"remote_share": 0.5, "uss_bytes": None, "pss_bytes": 31_000_000, "verdict": "ok",
                      "reason": "no-trend", "detail": "", "slope_per_1000_requests": 1.0e5,
                      "slope_per_minute": None, "history": [], "budget_bytes": 2 << 30},
              limits={"mode": "auto", "concurrency": None, "rate": None, "burst": None, "epoch": None,
                      "applied_epoch": 11, "source": None, "reason": None, "effective_limit": 10,
                      "l1_limit": 10.0},
              admission={"ceiling": None, "rate": 0.0, "burst": 1.0, "epoch": 11, "queued": 0,
                         "shed": {"overload": 3, "deadline": 2}, "codel_overloaded": True})
    s1["totals"]["connections"] = {"local": 5, "remote": 5, "unknown": 1}
    s1["totals"]["locality_share"] = 0.5
    s2 = slot(2, 1, state="drained", drained=True, binding_verified=None, pid=None, rss_bytes=0)
    return {
        "supervisor": {
            "pid": 6144, "state": "degraded", "uptime_s": 125.5, "runtime_dir": "/run/numaserve",
            "config_file": None, "listeners": ["127.0.0.1:8000", "[::1]:8000"],
            "accept_queue": {"0": [3, 0], "1": [0, None], "2": [0, 0]},
            "bad_messages": 2,
            "steering": {"mode": "numa", "healthy_slots": [0, 1], "program_attached": True, "updates": 5,
                         "errors": 0, "last_error": None, "locality_share": 0.93},
            "irq": {"applied": True, "irqs": 4, "failed": [{"irq": 40, "status": "managed"}], "warnings": [],
                    "state_file": "/run/numaserve/irq-saved.json", "placement": {"36": [0], "37": [1], "38": [0, 1]}},
            "app": "numaserve.apps.demo:app", "cmd": "", "loop_heartbeat_age_s": 0.12,
            "admin": "127.0.0.1:9180",
        },
        "plan": {"skipped": [], "notes": []},
        "slots": [s0, s1, s2],
        "operations": [
            {"id": "a1", "kind": "reload", "state": "succeeded"},
            {"id": "a2", "kind": "drain", "state": "succeeded"},
            {"id": "a3", "kind": "restart", "state": "failed"},
            {"id": "a4", "kind": "reload", "state": "running"},
        ],
    }


#: Every metric the brief names (family names as the parser reports them: counters without _total).
EXPECTED = {
    "numaserve_requests": "counter",
    "numaserve_request_duration_seconds": "histogram",
    "numaserve_inflight_requests": "gauge",
    "numaserve_open_connections": "gauge",
    "numaserve_queued_requests": "gauge",
    "numaserve_shed_requests": "counter",
    "numaserve_shed_requests_by_reason": "counter",
    "numaserve_limit_concurrency": "gauge",
    "numaserve_limit_rate_requests_per_second": "gauge",
    "numaserve_limit_burst_requests": "gauge",
    "numaserve_limits_epoch": "gauge",
    "numaserve_limits_applied_epoch": "gauge",
    "numaserve_admission_limit": "gauge",
    "numaserve_admission_overloaded": "gauge",
    "numaserve_accepted_connections": "counter",
    "numaserve_worker_rss_bytes": "gauge",
    "numaserve_worker_pss_bytes": "gauge",
    "numaserve_worker_uss_bytes": "gauge",
    "numaserve_leak_slope_bytes_per_1000_requests": "gauge",
    "numaserve_leak_slope_bytes_per_second": "gauge",
    "numaserve_leak_verdict": "gauge",
    "numaserve_leak_budget_bytes": "gauge",
    "numaserve_worker_restarts": "counter",
    "numaserve_binding_verified": "gauge",
    "numaserve_worker_remote_memory_ratio": "gauge",
    "numaserve_accept_queue_depth": "gauge",
    "numaserve_steering_locality_ratio": "gauge",
    "numaserve_steering_overall_locality_ratio": "gauge",
    "numaserve_steering_program_attached": "gauge",
    "numaserve_steering_mode": "gauge",
    "numaserve_steering_healthy_slots": "gauge",
    "numaserve_steering_updates": "counter",
    "numaserve_steering_errors": "counter",
    "numaserve_irq_steering_applied": "gauge",
    "numaserve_irq_steered_irqs": "gauge",
    "numaserve_irq_failed_irqs": "gauge",
    "numaserve_irq_placement_irqs": "gauge",
    "numaserve_slot_state": "gauge",
    "numaserve_supervisor_uptime_seconds": "gauge",
    "numaserve_supervisor_ready": "gauge",
    "numaserve_supervisor_state": "gauge",
    "numaserve_supervisor_loop_heartbeat_age_seconds": "gauge",
    "numaserve_operations": "counter",
    "numaserve_operations_running": "gauge",
    "numaserve_bad_control_messages": "counter",
    "numaserve_build_info": "gauge",
    "numaserve_worker_loop_lag_seconds": "gauge",
    "numaserve_metrics_errors": "counter",
}


def scrape(collector: NumaserveCollector) -> str:
    return generate_latest(make_registry(collector)).decode()


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    out = []
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()):
                out.append((smp.labels, smp.value))
    return out


def value(text: str, name: str, **labels: str) -> float:
    found = samples(text, name, **labels)
    assert len(found) == 1, (name, labels, found)
    return found[0][1]


def cpu_node() -> dict[int, int]:
    return {0: 0, 1: 1}


# --------------------------------------------------------------- exposition


def test_every_named_metric_present_with_optional_data() -> None:
    c = NumaserveCollector(full_snapshot, cpu_node=cpu_node())
    fams = families(scrape(c))
    missing = {n for n in EXPECTED if n not in fams}
    assert not missing, f"missing metrics: {sorted(missing)}"
    wrong = {n: fams[n].type for n, t in EXPECTED.items() if fams[n].type != t}
    assert not wrong
    assert c.errors == 0
    for f in fams.values():
        assert f.samples, f"{f.name} exported without samples"


def test_names_units_and_labels_follow_conventions() -> None:
    text = scrape(NumaserveCollector(full_snapshot, cpu_node=cpu_node()))
    for fam in text_string_to_metric_families(text):
        assert fam.name.startswith("numaserve_")
        for smp in fam.samples:
            assert "pid" not in smp.labels and "generation" not in smp.labels, smp
            if fam.type == "counter":
                assert smp.name.endswith(("_total", "_created")), smp.name
            if "slot" in smp.labels:
                assert "node" in smp.labels, smp
    assert value(text, "numaserve_limit_rate_requests_per_second", slot="0") == 500.0


def test_values_from_the_snapshot() -> None:
    text = scrape(NumaserveCollector(full_snapshot, cpu_node=cpu_node()))
    assert value(text, "numaserve_requests_total", slot="0", node="0", status_class="2xx") == 2
    assert value(text, "numaserve_requests_total", slot="0", status_class="5xx") == 1
    assert value(text, "numaserve_requests_total", slot="0", status_class="4xx") == 0  # pre-initialised
    assert value(text, "numaserve_worker_restarts_total", slot="0", reason="sigkill") == 1
    assert value(text, "numaserve_worker_restarts_total", slot="0", reason="hung") == 0
    assert value(text, "numaserve_queued_requests", slot="0") == 4
    assert value(text, "numaserve_shed_requests_total", slot="0") == 7
    assert value(text, "numaserve_shed_requests_total", slot="1") == 5
    assert value(text, "numaserve_shed_requests_by_reason_total", slot="1", reason="overload") == 3
    assert value(text, "numaserve_shed_requests_total", slot="2") == 0  # admission data absent → 0
    assert value(text, "numaserve_limits_epoch", slot="0") == 12
    assert not samples(text, "numaserve_limits_epoch", slot="1")       # nothing pushed yet
    assert value(text, "numaserve_limits_applied_epoch", slot="1") == 11  # from the gate
    assert value(text, "numaserve_limits_applied_epoch", slot="0") == 12
    assert value(text, "numaserve_limit_concurrency", slot="0") == 64
    assert not samples(text, "numaserve_limit_concurrency", slot="1")  # no ceiling: absent
    assert not samples(text, "numaserve_limit_rate_requests_per_second", slot="1")  # rate 0 = unlimited
    assert value(text, "numaserve_admission_limit", slot="1") == 10
    assert value(text, "numaserve_admission_overloaded", slot="1") == 1
    assert value(text, "numaserve_accepted_connections_total", slot="0", locality="remote") == 10
    assert value(text, "numaserve_accepted_connections_total", slot="0", locality="unknown") == 0
    assert value(text, "numaserve_steering_locality_ratio", slot="0") == 0.97
    assert value(text, "numaserve_steering_locality_ratio", slot="1") == 0.5   # from totals
    assert value(text, "numaserve_steering_overall_locality_ratio") == 0.93
    assert value(text, "numaserve_worker_pss_bytes", slot="1") == 31_000_000
    assert not samples(text, "numaserve_worker_pss_bytes", slot="2")
    assert value(text, "numaserve_worker_remote_memory_ratio", slot="1") == 0.5
    assert value(text, "numaserve_leak_slope_bytes_per_second", slot="0") == 1.0e4
    assert value(text, "numaserve_leak_verdict", slot="0", verdict="suspect") == 1
    assert value(text, "numaserve_leak_verdict", slot="0", verdict="leak") == 0
    assert value(text, "numaserve_leak_verdict", slot="1", verdict="ok") == 1    # from the memory dict
    assert value(text, "numaserve_leak_slope_bytes_per_1000_requests", slot="1") == 1.0e5
    assert not samples(text, "numaserve_leak_slope_bytes_per_second", slot="1")
    assert value(text, "numaserve_leak_budget_bytes", slot="1") == 2 << 30
    assert not samples(text, "numaserve_worker_uss_bytes", slot="1")
    assert value(text, "numaserve_binding_verified", slot="0") == 1
    assert not samples(text, "numaserve_binding_verified", slot="2")  # unknown: absent, not a false 0
    assert value(text, "numaserve_accept_queue_depth", slot="0", address="127.0.0.1:8000") == 3
    assert value(text, "numaserve_accept_queue_depth", slot="0", address="[::1]:8000") == 0
    assert not samples(text, "numaserve_accept_queue_depth", slot="1", address="[::1]:8000")  # None
    assert value(text, "numaserve_steering_program_attached") == 1
    assert value(text, "numaserve_steering_mode", mode="numa") == 1
    assert value(text, "numaserve_irq_failed_irqs", status="managed") == 1
    assert value(text, "numaserve_irq_placement_irqs", node="0") == 1
    assert value(text, "numaserve_irq_placement_irqs", node="mixed") == 1
    assert value(text, "numaserve_slot_state", slot="2", state="drained") == 1
    assert sum(v for _, v in samples(text, "numaserve_slot_state", slot="2")) == 1
    assert value(text, "numaserve_supervisor_state", state="degraded") == 1
    assert value(text, "numaserve_supervisor_ready") == 1  # the drained slot does not count
    assert value(text, "numaserve_bad_control_messages_total") == 2
    assert value(text, "numaserve_operations_total", kind="reload", result="succeeded") == 1
    assert value(text, "numaserve_operations_total", kind="restart", result="failed") == 1
    assert value(text, "numaserve_operations_running") == 1
    assert value(text, "numaserve_supervisor_uptime_seconds") == 125.5


def test_latency_histogram_rebuckets_onto_standard_seconds() -> None:
    text = scrape(NumaserveCollector(full_snapshot))
    got = {lab["le"]: v for lab, v in samples(text, "numaserve_request_duration_seconds_bucket", slot="0")}
    assert list(got) == ["0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5",
                         "5.0", "10.0", "+Inf"]
    assert len(STANDARD_BUCKETS_MS) == 13
    # observations 0.5 ms, 3 ms, 40 ms
    assert got["0.001"] == 1 and got["0.0025"] == 1 and got["0.005"] == 2 and got["0.025"] == 2
    assert got["0.05"] == 3 and got["+Inf"] == 3
    assert value(text, "numaserve_request_duration_seconds_count", slot="0") == 3
    assert value(text, "numaserve_request_duration_seconds_sum", slot="0") == pytest.approx(0.0435)


def test_rebucket_never_counts_a_straddling_bucket_below_its_bound() -> None:
    counts = [0] * N_FINE
    i = next(k for k, up in enumerate(BUCKET_UPPER_MS) if up > 1.0)  # the fine bucket holding (…, >1 ms]
    counts[i] = 5
    cum = rebucket(counts)
    assert cum[0] == 0 and cum[1] == 5          # not <= 1 ms for sure; surely <= 2.5 ms
    assert rebucket([1] * N_FINE)[-1] == sum(1 for up in BUCKET_UPPER_MS if up <= 10000)
    assert all(a <= b for a, b in zip(cum, cum[1:]))


def test_quantiles_from_rebucketed_histogram_are_close() -> None:
    lat = [1.0 + 0.37 * k for k in range(1000)]  # 1 .. 370 ms
    s = slot(0, 0, lat=tuple(lat))
    cum = rebucket(s["totals"]["latency_buckets"])
    # p50 ~ 186 ms lies in (100, 250]; the cumulative count at 100 ms is below half, at 250 ms above
    bounds = list(STANDARD_BUCKETS_MS)
    assert cum[bounds.index(100)] < 500 <= cum[bounds.index(250)]


# ------------------------------------------------------------ robustness


def test_empty_and_garbage_snapshots_never_raise() -> None:
    for snap in ({}, {"slots": None}, {"slots": ["x", 3]}, {"supervisor": "?"}, [],
                 {"supervisor": {"accept_queue": {"0": "deep"}, "steering": {"updates": "many"},
                                 "irq": {"failed": ["?"], "placement": {"1": "x"}}, "uptime_s": float("nan")},
                  "slots": [{"slot": 0, "node": 0, "state": 7, "totals": {"latency_buckets": ["a", None]},
                             "leak": {"verdict": 3}, "limits": "high", "shed": "lots"}],
                  "operations": "none"}):
        c = NumaserveCollector(lambda snap=snap: snap, cpu_node={0: 0})
        text = scrape(c)
        assert "numaserve_build_info" in families(text)


def test_snapshot_that_raises_still_scrapes() -> None:
    def boom() -> dict[str, Any]:
        raise RuntimeError("supervisor busy")

    c = NumaserveCollector(boom)
    text = scrape(c)
    assert value(text, "numaserve_metrics_errors_total") == 1
    assert "numaserve_build_info" in families(text)


def test_a_section_that_fails_is_counted_and_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    c = NumaserveCollector(full_snapshot)

    def broken(*a: Any) -> None:
        raise ValueError("bad")

    monkeypatch.setattr(c, "_slot_leak", broken)
    text = scrape(c)
    assert "numaserve_leak_verdict" not in families(text)
    assert "numaserve_requests" in families(text)
    assert value(text, "numaserve_metrics_errors_total") == 3  # one per slot


def test_missing_optional_data_means_absent_metrics() -> None:
    snap = full_snapshot()
    snap["supervisor"]["irq"] = None
    snap["supervisor"]["steering"] = None
    for s in snap["slots"]:
        for k in ("queued", "shed", "pss_bytes", "uss_bytes", "remote_memory_share", "steering_locality",
                  "limits", "limits_epoch", "leak", "memory", "admission"):
            s.pop(k, None)
        s["totals"].pop("connections", None)
        s["totals"].pop("locality_share", None)
    fams = families(scrape(NumaserveCollector(lambda: snap)))
    for absent in ("numaserve_worker_pss_bytes", "numaserve_leak_verdict", "numaserve_limits_epoch",
                   "numaserve_irq_steering_applied", "numaserve_steering_program_attached",
                   "numaserve_worker_remote_memory_ratio", "numaserve_shed_requests_by_reason",
                   "numaserve_admission_limit", "numaserve_accepted_connections", "numaserve_limit_concurrency",
                   "numaserve_steering_locality_ratio"):
        assert absent not in fams
    assert all(s.value == 0 for s in fams["numaserve_queued_requests"].samples)


# ------------------------------------------------------------ monotonicity


class _FakePopen:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> None:
        return None


def _worker(gen: int) -> S.WorkerProc:
    return S.WorkerProc(generation=gen, popen=_FakePopen(1000 + gen), started=0.0)  # type: ignore[arg-type]


def _stats(gen: int, n2xx: int, n5xx: int, lat: list[float]) -> Stats:
    return Stats(slot=0, generation=gen, requests=n2xx + n5xx, inflight=0,
                 status_classes={"2xx": n2xx, "5xx": n5xx},
                 extra={"latency_buckets": fine_buckets(*lat), "latency_count": len(lat),
                        "latency_sum_ms": sum(lat)})


def _slot_state() -> S.SlotState:
    plan = SlotPlan(slot=0, node=0, index=0, cpus=(0,), mempolicy="bind", memory_nodes=(0,))
    return S.SlotState(plan=plan, restart=RestartState(RestartPolicy()))


def _counters(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.type in ("counter", "histogram"):
            for smp in fam.samples:
                if smp.name.endswith(("_total", "_bucket", "_count", "_sum")):
                    out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def _assert_monotonic(series: list[str]) -> None:
    prev: dict[Any, float] = {}
    for text in series:
        cur = _counters(text)
        for k, v in prev.items():
            assert k in cur, f"{k} disappeared"
            assert cur[k] >= v, f"{k} went down: {v} -> {cur[k]}"
        prev = cur


def test_counters_monotonic_across_a_worker_restart() -> None:
    """Crash: the dead worker's counts move into the slot totals; the new one starts at 0."""
    st = _slot_state()
    st.state = S.READY
    snap: dict[str, Any] = {}
    c = NumaserveCollector(lambda: snap)
    texts = []

    def take() -> None:
        snap.clear()
        snap.update({"supervisor": {"state": "running", "uptime_s": 1.0}, "slots": [st.status(0.0)]})
        texts.append(scrape(c))

    st.worker = _worker(1)
    st.generation = 1
    st.worker.stats = _stats(1, 10, 1, [2.0] * 11)
    take()
    st.worker.stats = _stats(1, 20, 2, [2.0] * 20 + [300.0, 300.0])
    take()
    # crash: reaped (as Supervisor._on_exit does), restarted with a fresh counter
    st.totals_before.add_stats(st.worker.stats)
    st.totals_before.restarts_by_reason["sigkill"] = 1
    st.worker, st.state = None, S.BACKOFF
    take()
    st.worker, st.generation, st.state = _worker(2), 2, S.READY
    take()
    st.worker.stats = _stats(2, 3, 0, [1.0] * 3)
    take()
    _assert_monotonic(texts)
    last = texts[-1]
    assert value(last, "numaserve_requests_total", status_class="2xx") == 23
    assert value(last, "numaserve_request_duration_seconds_count") == 25
    assert value(last, "numaserve_worker_restarts_total", reason="sigkill") == 1


def test_counters_do_not_dip_while_a_retiring_worker_is_not_yet_reaped() -> None:
    """Rolling reload: the old generation moves to ``retiring`` before it is reaped; the
    snapshot's totals dip meanwhile, the exported counters must not (a dip reads as a reset)."""
    st = _slot_state()
    st.state = S.READY
    snap: dict[str, Any] = {}
    c = NumaserveCollector(lambda: snap)
    texts = []

    def take() -> None:
        snap.clear()
        snap.update({"slots": [st.status(0.0)]})
        texts.append(scrape(c))

    old = _worker(1)
    old.stats = _stats(1, 50, 0, [5.0] * 50)
    st.worker, st.generation = old, 1
    take()
    new = _worker(2)
    new.stats = _stats(2, 1, 0, [5.0])
    st.worker, st.retiring, st.generation = new, [old], 2   # swapped, old still draining
    take()
    st.retiring = []
    st.totals_before.add_stats(old.stats)                   # reaped
    new.stats = _stats(2, 4, 0, [5.0] * 4)
    take()
    _assert_monotonic(texts)
    assert value(texts[-1], "numaserve_requests_total", status_class="2xx") == 54


def test_histogram_kept_whole_when_the_snapshot_dips() -> None:
    snaps = [full_snapshot(), full_snapshot()]
    snaps[1]["slots"][0]["totals"]["latency_buckets"] = fine_buckets(0.5)   # fewer than before
    snaps[1]["slots"][0]["totals"]["latency_count"] = 1
    it = iter(snaps)
    c = NumaserveCollector(lambda: next(it))
    first, second = scrape(c), scrape(c)
    key = "numaserve_request_duration_seconds_bucket"
    assert samples(first, key, slot="0") == samples(second, key, slot="0")


def test_operations_counted_once_per_id() -> None:
    snap = full_snapshot()
    c = NumaserveCollector(lambda: snap)
    scrape(c)
    text = scrape(c)
    assert value(text, "numaserve_operations_total", kind="reload", result="succeeded") == 1
    snap["operations"] = snap["operations"][1:3] + [{"id": "a4", "kind": "reload", "state": "succeeded"},
                                                    {"id": "a5", "kind": "reload", "state": "succeeded"}]
    text = scrape(c)
    assert value(text, "numaserve_operations_total", kind="reload", result="succeeded") == 3
    assert value(text, "numaserve_operations_running") == 0


def test_restart_reason_vocabulary_matches_slots_module() -> None:
    for reason in ("hung: no heartbeat for 11s", "not ready within 60s", "killed by SIGKILL (out of memory?)",
                   "killed by SIGSEGV", "exit 3 (app failed to load)", "spawn failed: x", "leak: slope",
                   "reload", "exit 1", "weird"):
        assert S.restart_reason_class(reason) in RESTART_REASONS


# --------------------------------------------------------------- readiness


def test_unready_slots() -> None:
    snap = full_snapshot()
    assert unready_slots(snap) == []
    snap["slots"][1]["state"] = "backoff"
    snap["slots"][1]["last_exit"] = "killed by SIGKILL"
    assert unready_slots(snap) == [{"slot": 1, "node": 1, "state": "backoff", "reason": "killed by SIGKILL"}]
    for s in snap["slots"]:
        s["state"], s["drained"] = "drained", True
    assert unready_slots(snap)[0]["reason"] == "no slot is serving"


# -------------------------------------------------------------- admin app


class FakeSup:
    def __init__(self) -> None:
        self.snap = full_snapshot()
        self.stopping = False
        self.state = "running"
        self.heartbeat = LoopHeartbeat()
        self.topology = None

    def status(self) -> dict[str, Any]:
        return copy.deepcopy(self.snap)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _client(sup: FakeSup, hb: LoopHeartbeat) -> httpx.AsyncClient:
    app = build_app(sup, hb, stale_after=5.0, cpu_node=cpu_node())
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin")


def test_admin_app_routes() -> None:
    async def run() -> None:
        sup = FakeSup()
        clock = Clock()
        hb = LoopHeartbeat(clock)
        async with _client(sup, hb) as c:
            r = await c.get("/metrics")
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/plain")
            fams = families(r.text)
            assert "numaserve_slot_state" in fams
            assert value(r.text, "numaserve_supervisor_loop_heartbeat_age_seconds") == 0

            r = await c.get("/healthz")
            assert r.status_code == 200 and r.json()["status"] == "ok"
            clock.t += 6.0   # the loop did not tick for 6 s
            r = await c.get("/healthz")
            assert r.status_code == 503 and "not ticked" in r.json()["reason"]
            hb.beat()
            assert (await c.get("/healthz")).status_code == 200

            r = await c.get("/readyz")
            assert r.status_code == 200, r.text
            sup.snap["slots"][0]["state"] = "starting"
            r = await c.get("/readyz")
            assert r.status_code == 503
            assert [u["slot"] for u in r.json()["unready"]] == [0]

            sup.stopping = True
            assert (await c.get("/healthz")).json()["reason"] == "stopping"
            assert (await c.get("/healthz")).status_code == 503
            assert (await c.get("/readyz")).status_code == 503

            assert (await c.get("/")).status_code == 404
            assert (await c.get("/metrics/x")).status_code == 404
            r = await c.post("/metrics")
            assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD"
            r = await c.head("/healthz")
            assert r.status_code == 503 and r.content == b""

    asyncio.run(run())


def test_admin_readyz_when_status_raises() -> None:
    async def run() -> None:
        sup = FakeSup()

        def boom() -> dict[str, Any]:
            raise RuntimeError("x")

        sup.status = boom  # type: ignore[method-assign]
        async with _client(sup, LoopHeartbeat()) as c:
            assert (await c.get("/readyz")).status_code == 503
            assert (await c.get("/metrics")).status_code == 200

    asyncio.run(run())


def test_admin_server_in_the_running_loop_over_real_http() -> None:
    async def run() -> None:
        sup = FakeSup()
        handle = await start_admin(sup, AdminConfig(bind="127.0.0.1:0"))
        assert handle is not None
        try:
            host, port = handle.address.rsplit(":", 1)
            assert host == "127.0.0.1" and int(port) > 0
            async with httpx.AsyncClient(base_url=handle.url) as c:
                assert (await c.get("/healthz")).status_code == 200
                r = await c.get("/metrics")
                assert value(r.text, "numaserve_supervisor_ready") == 1
        finally:
            await handle.stop()
        assert handle.task.done()
        with pytest.raises(httpx.ConnectError):
            httpx.get(handle.url + "/healthz", timeout=1)

    asyncio.run(run())


def test_admin_disabled_and_bad_bind() -> None:
    from numaserve.errors import NumaserveError

    assert open_admin_socket(AdminConfig(bind="")) is None
    assert asyncio.run(start_admin(FakeSup(), AdminConfig(bind=""))) is None
    with pytest.raises(NumaserveError, match="admin.bind"):
        open_admin_socket(AdminConfig(bind="nonsense"))
    busy = open_admin_socket(AdminConfig(bind="127.0.0.1:0"))
    assert busy is not None
    try:
        port = busy.getsockname()[1]
        with pytest.raises(NumaserveError, match="cannot listen"):
            open_admin_socket(AdminConfig(bind=f"127.0.0.1:{port}"))
    finally:
        busy.close()


# ----------------------------------------------------------- grafana dashboard


DASHBOARD = REPO / "config" / "grafana-dashboard.json"

_FUNCTIONS = {"sum", "rate", "irate", "increase", "histogram_quantile", "max", "min", "avg", "count", "topk",
              "bottomk", "deriv", "delta", "abs", "clamp_min", "clamp_max", "changes", "resets", "time", "vector",
              "scalar", "label_replace", "avg_over_time", "max_over_time", "min_over_time", "last_over_time",
              "absent", "quantile"}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "and", "or", "unless",
             "bool"}
_TOKEN = re.compile(
    r'(?P<ws>\s+)|(?P<str>"(?:[^"\\]|\\.)*")|(?P<range>\[\d+[smhdwy]\])|(?P<num>\d+(?:\.\d+)?)'
    r'|(?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=])|(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)|(?P<punct>[(){},])'
)


def parse_promql(expr: str) -> list[str]:
    """A small PromQL checker (promtool is not installed here): tokens, nesting, known
    functions, label matchers, range selectors, grouping clauses.  Returns the metric
    names used; raises AssertionError on a malformed expression."""
    e = expr.replace("$__rate_interval", "1m").replace("$__interval", "1m")
    m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", e)   # a Grafana variable query
    if m:
        e = m.group(1)
    toks: list[tuple[str, str]] = []
    pos = 0
    while pos < len(e):
        mt = _TOKEN.match(e, pos)
        assert mt, f"cannot tokenize at {e[pos:pos + 20]!r} in {expr!r}"
        pos = mt.end()
        if mt.lastgroup != "ws":
            toks.append((mt.lastgroup or "", mt.group()))
    stack: list[str] = []     # "(", "{", or "g" for a grouping list after by/without
    names: list[str] = []
    for i, (kind, text) in enumerate(toks):
        nxt = toks[i + 1][1] if i + 1 < len(toks) else ""
        prev = toks[i - 1] if i else ("", "")
        if text == "(":
            stack.append("g" if prev[1] in ("by", "without", "on", "ignoring") else "(")
        elif text == "{":
            stack.append("{")
        elif text in ")}":
            top = stack.pop() if stack else None
            assert top == "{" if text == "}" else top in ("(", "g"), f"unbalanced {text} in {expr!r}"
        elif kind == "range":
            assert prev[1] == "}" or prev[0] == "ident", f"range without a selector in {expr!r}"
        elif kind == "ident" and stack and stack[-1] == "{":
            assert nxt in ("=", "!=", "=~", "!~"), f"bad label matcher at {text!r} in {expr!r}"
            assert i + 2 < len(toks) and toks[i + 2][0] == "str", f"label {text} needs a quoted value in {expr!r}"
        elif kind == "ident" and stack and stack[-1] == "g":
            assert nxt in (",", ")"), f"grouping list: {expr!r}"
        elif kind == "ident":
            if nxt == "(" or nxt in ("by", "without"):
                assert text in _FUNCTIONS or text in _KEYWORDS, f"unknown function {text} in {expr!r}"
            elif text not in _KEYWORDS:
                assert text.startswith("numaserve_"), f"{text}: not a numaserve metric in {expr!r}"
                names.append(text)
    assert not stack, f"unclosed {stack} in {expr!r}"
    return names


def test_promql_checker_catches_mistakes() -> None:
    assert parse_promql('sum by (le) (rate(numaserve_x_bucket{a=~"$b"}[$__rate_interval]))') == [
        "numaserve_x_bucket"]
    for bad in ('sum(rate(numaserve_x[1m])', 'numaserve_x{a="b"', 'numaserve_x{a}', 'rte(numaserve_x[1m])',
                'sum by (x) (up)', 'numaserve_x{a="b"}]'):
        with pytest.raises(AssertionError):
            parse_promql(bad)


def _dashboard_exprs(dash: dict[str, Any]) -> list[str]:
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                if "expr" in t:
                    out.append(t["expr"])
            walk(p.get("panels", []))

    walk(dash["panels"])
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, dict):
            q = q.get("query")
        if isinstance(q, str) and "numaserve_" in q:
            out.append(q)
    return out


def _exposed_names(text: str) -> set[str]:
    return {smp.name for fam in text_string_to_metric_families(text) for smp in fam.samples}


def test_dashboard_is_valid_and_queries_only_exported_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["schemaVersion"] >= 36
    assert any(i.get("name") == "DS_PROMETHEUS" and i.get("pluginId") == "prometheus"
               for i in dash.get("__inputs", []))
    exprs = _dashboard_exprs(dash)
    assert len(exprs) >= 10
    exposed = _exposed_names(scrape(NumaserveCollector(full_snapshot, cpu_node=cpu_node())))
    referenced = set()
    for e in exprs:
        for name in parse_promql(e):
            referenced.add(name)
            assert name in exposed, f"dashboard queries {name}, which the collector does not export ({e})"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        if p.get("type") != "row":
            assert p["datasource"]["uid"] == "${DS_PROMETHEUS}", p["title"]
    for needed in ("numaserve_requests_total", "numaserve_request_duration_seconds_bucket",
                   "numaserve_inflight_requests", "numaserve_queued_requests", "numaserve_shed_requests_total",
                   "numaserve_worker_rss_bytes", "numaserve_worker_pss_bytes",
                   "numaserve_leak_slope_bytes_per_1000_requests", "numaserve_worker_restarts_total",
                   "numaserve_binding_verified", "numaserve_accept_queue_depth",
                   "numaserve_steering_locality_ratio", "numaserve_slot_state"):
        assert needed in referenced, f"no panel shows {needed}"


def test_admin_readyz_degraded_when_the_missing_slots_failed() -> None:
    async def run() -> None:
        sup = FakeSup()
        slots = sup.snap["slots"]
        assert len(slots) >= 2
        sup.snap["supervisor"]["state"] = "degraded"
        slots[1]["state"] = "failed"
        slots[1]["failed_reason"] = "app load failed: boom"
        async with _client(sup, LoopHeartbeat()) as c:
            r = await c.get("/readyz")
            assert r.status_code == 200 and r.json()["status"] == "degraded", r.text
            assert r.json()["missing"][0]["slot"] == slots[1]["slot"]
            assert "boom" in r.json()["missing"][0]["reason"]
            slots[0]["state"] = "backoff"          # restarting, not failed: not ready
            assert (await c.get("/readyz")).status_code == 503
            slots[0]["state"] = "ready"
            sup.snap["supervisor"]["state"] = "starting"   # boot not settled
            assert (await c.get("/readyz")).status_code == 503

    asyncio.run(run())


def test_worker_exits_by_kind_are_exported() -> None:
    snap = full_snapshot()
    snap["slots"][0]["totals"]["exits_by_kind"] = {"external": 3, "crash": 1}
    from numaserve.supervisor.metrics import NumaserveCollector, make_registry
    from prometheus_client import generate_latest

    text = generate_latest(make_registry(NumaserveCollector(lambda: snap))).decode()
    assert value(text, "numaserve_worker_exits_total", slot="0", kind="external") == 3
    assert value(text, "numaserve_worker_exits_total", slot="0", kind="crash") == 1
    assert value(text, "numaserve_worker_exits_total", slot="0", kind="hang") == 0


def test_control_plane_metrics() -> None:
    def snap() -> dict[str, Any]:
        s = full_snapshot()
        s["supervisor"]["control_plane"] = {"fds": {"open": 41, "limit": 256, "exhausted": 2},
                                            "ops_rate_limited": 7}
        return s

    text = scrape(NumaserveCollector(snap, cpu_node=cpu_node()))
    assert value(text, "numaserve_supervisor_open_fds") == 41
    assert value(text, "numaserve_supervisor_fd_limit") == 256
    assert value(text, "numaserve_supervisor_fd_exhausted_total") == 2
    assert value(text, "numaserve_ops_rate_limited_total") == 7


def test_the_metrics_stack_is_imported_at_the_first_scrape_not_at_start() -> None:
    """/readyz and /healthz answer without prometheus_client; the first /metrics loads it,
    and later scrapes reuse one collector (its counters' high-water marks)."""
    code = r'''
import asyncio, sys
import httpx
from numaserve.supervisor.admin import LoopHeartbeat, build_app

class Sup:
    stopping = False
    state = "running"
    def status(self):
        return {"supervisor": {"state": "running"}, "slots": [{"slot": 0, "node": 0, "state": "ready"}]}

async def main():
    app = build_app(Sup(), LoopHeartbeat(), cpu_node={})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin") as c:
        assert (await c.get("/readyz")).status_code == 200
        assert (await c.get("/healthz")).status_code == 200
        assert "prometheus_client" not in sys.modules, "imported before any scrape"
        assert "numaserve.supervisor.metrics" not in sys.modules
        r1 = await c.get("/metrics")
        r2 = await c.get("/metrics")
        assert r1.status_code == r2.status_code == 200
        assert "numaserve_slot_state" in r1.text and "numaserve_slot_state" in r2.text
        assert "prometheus_client" in sys.modules
asyncio.run(main())
print("ok")
'''
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
