"""Locality metrics from a status snapshot: per worker, per node, repairs (no processes)."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from numaserve.supervisor.metrics import NumaserveCollector, make_registry


def samples(snap: dict[str, Any], collector: NumaserveCollector | None = None) -> dict[tuple[str, tuple], float]:
    c = collector or NumaserveCollector(lambda: snap)
    text = generate_latest(make_registry(c)).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def slot(i: int, node: int, ratio: float | None, *, off: int = 0, resident: int = 1000,
         repairs: dict[str, int] | None = None) -> dict[str, Any]:
    return {"slot": i, "node": node, "state": "ready", "locality": {
        "local_ratio": ratio, "threads_off_node": off, "anon_bytes": resident,
        "remote_anon_bytes": None if ratio is None else int(resident * (1 - ratio)), "repairs": repairs or {}}}


def test_every_worker_gets_its_ratio_threads_and_zeroed_repair_counters() -> None:
    got = samples({"slots": [slot(0, 0, 1.0), slot(1, 1, 0.5, off=2, repairs={"migrate": 3})]})
    l0, l1 = (("node", "0"), ("slot", "0")), (("node", "1"), ("slot", "1"))
    assert got[("numaserve_worker_memory_local_ratio", l0)] == 1.0
    assert got[("numaserve_worker_memory_local_ratio", l1)] == 0.5
    assert got[("numaserve_worker_threads_off_node", l1)] == 2.0
    assert got[("numaserve_locality_repairs_total", (("action", "migrate"),) + l1)] == 3.0
    assert got[("numaserve_locality_repairs_total", (("action", "recycle"),) + l0)] == 0.0
    assert got[("numaserve_node_memory_remote_ratio", (("node", "1"),))] == 0.5
    assert got[("numaserve_node_memory_remote_ratio", (("node", "0"),))] == 0.0


def test_node_share_weighs_workers_by_resident_bytes_and_skips_unsampled_ones() -> None:
    got = samples({"slots": [slot(0, 0, 1.0, resident=3000), slot(1, 0, 0.0, resident=1000),
                             slot(2, 1, None)]})
    assert got[("numaserve_node_memory_remote_ratio", (("node", "0"),))] == 0.25
    assert ("numaserve_node_memory_remote_ratio", (("node", "1"),)) not in got
    assert ("numaserve_worker_memory_local_ratio", (("node", "1"), ("slot", "2"))) not in got


def test_no_locality_section_no_series_and_malformed_values_are_skipped() -> None:
    got = samples({"slots": [{"slot": 0, "node": 0, "state": "ready"}]})
    assert not any(k[0].startswith(("numaserve_worker_memory_local", "numaserve_locality")) for k in got)
    bad = {"slots": [{"slot": 0, "node": 0, "state": "ready", "locality": {"repairs": {"migrate": "x"},
                                                                          "anon_bytes": "?"}}]}
    c = NumaserveCollector(lambda: bad)
    got = samples(bad, c)
    assert got[("numaserve_locality_repairs_total", (("action", "migrate"), ("node", "0"), ("slot", "0")))] == 0.0


def test_the_dashboard_shows_the_locality_metrics() -> None:
    import json
    from pathlib import Path

    dash = json.loads((Path(__file__).resolve().parents[2] / "config" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t.get("expr", "") for p in dash["panels"] for t in p.get("targets", []))
    for name in ("numaserve_worker_memory_local_ratio", "numaserve_worker_threads_off_node",
                 "numaserve_node_memory_remote_ratio", "numaserve_locality_repairs_total"):
        assert name in exprs, name


def test_the_sampling_cost_is_exported_as_counters() -> None:
    got = samples({"supervisor": {"locality": {"samples": 120, "cpu_s": 0.34, "cpu_budget": 0.01}}, "slots": []})
    assert got[("numaserve_locality_samples_total", ())] == 120.0
    assert got[("numaserve_locality_sample_cpu_seconds_total", ())] == 0.34
