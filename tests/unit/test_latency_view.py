"""Per-slot latency from cumulative bucket counts: window, percentiles, histogram text."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest

from numaserve.tools.latency_view import (
    coarse_rows,
    fmt_ms,
    histogram_lines,
    latency_summary,
    latency_text,
    percentiles,
    render_latency,
    slot_latencies,
    window,
)
from numaserve.worker.stats import BUCKET_UPPER_MS, LatencyHistogram, bucket_index

N = len(BUCKET_UPPER_MS)


def counts_of(values_ms: list[float]) -> list[int]:
    h = LatencyHistogram()
    for v in values_ms:
        h.observe(v)
    return h.counts


def snapshot(*slots: tuple[int, list[int]], recent: dict[str, float] | None = None) -> dict[str, Any]:
    return {"slots": [{"slot": s, "node": 0, "pid": 100 + s, "state": "ready", "latency_ms": recent or {},
                       "totals": {"latency_buckets": b}} for s, b in slots]}


def test_window_is_exact_difference_and_survives_reset() -> None:
    assert window([1, 2, 3], [4, 2, 5]) == [3, 0, 2]
    assert window([1, 2], [1, 2, 7]) == [0, 0, 7]          # longer layout: missing counts are 0
    assert window([5, 5], [1, 9]) == [1, 9]                # counters went back: use the later snapshot


def test_percentiles_match_worker_estimator() -> None:
    values = [0.5] * 50 + [2.0] * 40 + [40.0] * 9 + [900.0]
    counts = counts_of(values)
    h = LatencyHistogram()
    for v in values:
        h.observe(v)
    p = percentiles(counts)
    assert set(p) == {"p50", "p90", "p99"}
    for key, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        exact = h.percentile(q)
        # same interpolation; the only difference is the unknown max (bucket top instead)
        assert p[key] == pytest.approx(exact, rel=0.2), key
    i = bucket_index(0.5)
    assert BUCKET_UPPER_MS[i - 1] <= p["p50"] <= BUCKET_UPPER_MS[i]
    assert BUCKET_UPPER_MS[bucket_index(40.0) - 1] <= p["p99"] <= BUCKET_UPPER_MS[bucket_index(40.0)]
    assert percentiles([0] * N) == {"p50": None, "p90": None, "p99": None}
    assert percentiles(counts, qs=(0.999,)).keys() == {"p99.9"}


def test_overflow_percentile_is_infinite() -> None:
    counts = [0] * N
    counts[-1] = 3
    assert math.isinf(percentiles(counts)["p50"])   # type: ignore[arg-type]
    rows = coarse_rows(counts)
    assert len(rows) == 1 and math.isinf(rows[0].hi_ms) and rows[0].count == 3


def test_coarse_rows_one_per_doubling_with_gaps_kept() -> None:
    counts = counts_of([0.3] * 5 + [5.0] * 2)
    rows = coarse_rows(counts)
    assert sum(r.count for r in rows) == 7
    assert rows[0].lo_ms < 0.3 <= rows[0].hi_ms and rows[-1].lo_ms < 5.0 <= rows[-1].hi_ms
    for a, b in zip(rows, rows[1:]):
        assert a.hi_ms == b.lo_ms and b.hi_ms == pytest.approx(2 * b.lo_ms)
    assert [r.count for r in rows[1:-1]] == [0] * (len(rows) - 2) and len(rows) > 2
    assert coarse_rows([0] * N) == []
    first = coarse_rows(counts_of([0.001]))
    assert first[0].lo_ms == 0.0 and first[0].hi_ms == BUCKET_UPPER_MS[0]


def test_histogram_lines_bars_and_percent() -> None:
    lines = histogram_lines(counts_of([1.0] * 30 + [2.0] * 10), width=20)
    assert len(lines) == 2
    assert lines[0].count("█") == 20 and lines[0].endswith("75.0%   75.0%")
    assert lines[1].endswith("25.0%  100.0%")
    assert lines[1].count("█") == 6 and "▋" in lines[1]          # 20 * 1/3 = 6.67 cells
    assert histogram_lines([0] * N) == ["(no requests)"]


def test_fmt_ms() -> None:
    assert fmt_ms(None) == "-"
    assert fmt_ms(0.04) == "40µs"
    assert fmt_ms(1.234) == "1.23ms"
    assert fmt_ms(12.34) == "12.3ms"
    assert fmt_ms(250.0) == "250ms"
    assert fmt_ms(2600.0) == "2.60s"
    assert fmt_ms(math.inf) == "inf"


def test_slot_latencies_cumulative_and_windowed() -> None:
    before = snapshot((0, counts_of([1.0] * 100)), (1, counts_of([2.0] * 10)))
    after = snapshot((0, counts_of([1.0] * 100 + [50.0] * 20)), (1, counts_of([2.0] * 10)), (2, [0] * N))
    cum = slot_latencies(after)
    assert [s.count for s in cum] == [120, 10, 0] and not cum[0].windowed
    win = slot_latencies(after, before)
    assert win[0].windowed and win[0].count == 20
    assert win[0].pcts["p50"] is not None and win[0].pcts["p50"] > 30     # only the new slow requests
    assert win[1].count == 0 and win[1].pcts["p50"] is None
    assert not win[2].windowed and win[2].count == 0                      # a slot new since `before`


def test_unknown_layout_is_reported_not_misread() -> None:
    s = slot_latencies(snapshot((0, [1, 2, 3])))[0]
    assert s.problem and "unknown bucket layout" in s.problem and s.count == 0
    assert "unknown bucket layout" in latency_text(snapshot((0, [1, 2, 3])))


def test_summary_and_text_and_rich() -> None:
    snap = snapshot((0, counts_of([0.8] * 90 + [20.0] * 10)), (1, []), recent={"p50": 0.7, "p99": 19.0})
    js = latency_summary(snap)
    assert js[0]["requests"] == 100 and js[0]["p50"] < 1.0 and js[0]["p99"] > 10
    assert sum(r["count"] for r in js[0]["rows"]) == 100
    assert js[1]["requests"] == 0 and js[1]["rows"] == []
    text = latency_text(snap)
    assert "slot 0 (node 0, pid 100, ready): 100 requests since start" in text
    assert "p99" in text and "worker's recent window" in text and "slot 1" in text
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=140, color_system=None).print(render_latency(snap))
    out = buf.getvalue()
    assert "slot 0" in out and "slot 1" in out and "█" in out and "cum %" in out
