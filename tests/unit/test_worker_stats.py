"""Latency histogram and stats snapshot."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from numaserve.control.messages import Stats, decode_from_worker, encode
from numaserve.worker.stats import (
    BUCKET_SCHEMA,
    BUCKET_UPPER_MS,
    LatencyHistogram,
    WindowedHistogram,
    WorkerStats,
    bucket_index,
    read_rss_bytes,
    status_class,
)


def test_bucket_bounds_are_log_scaled_and_end_in_overflow() -> None:
    assert BUCKET_UPPER_MS[0] == 0.01 and math.isinf(BUCKET_UPPER_MS[-1])
    ratios = {round(b / a, 6) for a, b in zip(BUCKET_UPPER_MS, BUCKET_UPPER_MS[1:-1])}
    assert ratios == {round(2 ** 0.25, 6)}
    assert BUCKET_UPPER_MS[-2] > 120_000
    assert BUCKET_SCHEMA.endswith(f":{len(BUCKET_UPPER_MS)}")


def test_bucket_index_edges() -> None:
    assert bucket_index(0.0) == 0
    assert bucket_index(0.01) == 0
    assert bucket_index(0.0101) == 1
    assert bucket_index(BUCKET_UPPER_MS[40]) == 40
    assert bucket_index(1e12) == len(BUCKET_UPPER_MS) - 1


def test_empty_summary_is_zero() -> None:
    assert LatencyHistogram().summary() == {"p50": 0.0, "p90": 0.0, "p99": 0.0, "mean": 0.0, "max": 0.0}


def test_percentiles_of_uniform_data_within_bucket_error() -> None:
    h = LatencyHistogram()
    for i in range(1, 1001):
        h.observe(float(i))
    s = h.summary()
    assert abs(s["p50"] - 500) / 500 < 0.19
    assert abs(s["p90"] - 900) / 900 < 0.19
    assert abs(s["p99"] - 990) / 990 < 0.19
    assert s["mean"] == 500.5 and s["max"] == 1000.0


def test_percentile_never_exceeds_max_and_single_value() -> None:
    h = LatencyHistogram()
    h.observe(3.0)
    assert h.percentile(0.5) <= 3.0 and h.percentile(0.99) <= 3.0 and h.max_ms == 3.0
    h.observe(1e9)  # overflow bucket
    assert h.percentile(0.99) == 1e9


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=0.001, max_value=100_000, allow_nan=False), min_size=1, max_size=300),
       st.sampled_from([0.5, 0.9, 0.99]))
def test_percentile_lands_in_the_true_quantiles_bucket(values: list[float], q: float) -> None:
    h = LatencyHistogram()
    for v in values:
        h.observe(v)
    est = h.percentile(q)
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    true = ordered[rank - 1]
    i = bucket_index(true)
    lo = BUCKET_UPPER_MS[i - 1] if i else 0.0
    assert lo - 1e-9 <= est <= BUCKET_UPPER_MS[i] + 1e-9


def test_merge_equals_union() -> None:
    a, b, u = LatencyHistogram(), LatencyHistogram(), LatencyHistogram()
    for i, v in enumerate([0.5, 2, 8, 40, 300, 7000]):
        (a if i % 2 else b).observe(v)
        u.observe(v)
    a.merge(b)
    assert a.counts == u.counts and a.count == u.count and a.max_ms == u.max_ms
    assert math.isclose(a.sum_ms, u.sum_ms)


def test_window_forgets_old_slots() -> None:
    w = WindowedHistogram(slots=3)
    w.observe(100.0)
    w.rotate()
    w.observe(1.0)
    assert w.merged().count == 2
    w.rotate()
    w.rotate()  # the slot holding 100 ms is reused and cleared
    m = w.merged()
    assert m.count == 1 and m.max_ms == 1.0


def test_status_class() -> None:
    assert [status_class(s) for s in (101, 200, 204, 302, 404, 503, 0, 999)] == \
        ["1xx", "2xx", "2xx", "3xx", "4xx", "5xx", "other", "other"]


def test_read_rss(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert read_rss_bytes() > 1 << 20
    assert read_rss_bytes(str(tmp_path / "missing")) == 0
    bad = tmp_path / "statm"
    bad.write_text("garbage")
    assert read_rss_bytes(str(bad)) == 0


def test_worker_stats_snapshot_builds_a_stats_message() -> None:
    ws = WorkerStats(window_slots=2)
    ws.request_started()
    ws.request_started()
    ws.request_finished(200, 5.0)
    ws.draining = True
    snap = ws.snapshot(connections=3, rss_bytes=1234)
    assert snap["requests"] == 1 and snap["inflight"] == 1 and snap["connections"] == 3
    assert snap["status_classes"] == {"2xx": 1} and snap["draining"] is True
    assert snap["extra"]["latency_count"] == 1 and sum(snap["extra"]["latency_buckets"]) == 1
    msg = Stats(slot=1, generation=2, **snap)
    assert decode_from_worker(encode(msg)) == msg
    # the window rotates, the cumulative counts stay (mergeable by the supervisor)
    ws.snapshot(rss_bytes=0)
    snap3 = ws.snapshot(rss_bytes=0)
    assert snap3["latency_ms"]["max"] == 0.0 and sum(snap3["extra"]["latency_buckets"]) == 1
