"""Per-slot latency from the supervisor's cumulative bucket counts (pure functions).

Each slot's ``totals.latency_buckets`` counts every request since the slot
started (all worker generations) on the fixed log-scale bounds
``BUCKET_UPPER_MS``.  Counts add and subtract exactly, so percentiles come
from the counts (never by averaging percentiles), and the difference of two
snapshots is the exact distribution of the requests in between: a recent
window without any extra state in the workers.

Used by ``numaserve status --latency`` and by ``numaserve loadtest --histogram``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from numaserve.worker.stats import BUCKET_UPPER_MS, LatencyHistogram

__all__ = [
    "HistRow",
    "SlotLatency",
    "coarse_rows",
    "fmt_ms",
    "histogram_lines",
    "latency_summary",
    "latency_text",
    "percentiles",
    "render_latency",
    "slot_latencies",
    "window",
]

_PER_ROW = 4          # fine buckets per row: one row per doubling of latency
_OVERFLOW = len(BUCKET_UPPER_MS) - 1
_BLOCKS = " ▏▎▍▌▋▊▉█"


def window(before: Sequence[int], after: Sequence[int]) -> list[int]:
    """Counts of the requests between two cumulative snapshots.

    A negative difference means the counters restarted (a new supervisor);
    then the later snapshot alone is the best answer.
    """
    n = max(len(before), len(after))
    a = list(after) + [0] * (n - len(after))
    b = list(before) + [0] * (n - len(before))
    diff = [x - y for x, y in zip(a, b)]
    return a if any(d < 0 for d in diff) else diff


def _hist(buckets: Sequence[int]) -> LatencyHistogram:
    """A worker-style histogram over these counts (same estimator as the workers)."""
    h = LatencyHistogram()
    counts = list(buckets)[: len(BUCKET_UPPER_MS)]
    h.counts = counts + [0] * (len(BUCKET_UPPER_MS) - len(counts))
    h.count = sum(h.counts)
    top = max((i for i, c in enumerate(h.counts) if c), default=-1)
    # the true maximum is unknown: the top of the highest non-empty bucket bounds it
    h.max_ms = 0.0 if top < 0 else BUCKET_UPPER_MS[top]
    return h


def percentiles(buckets: Sequence[int], qs: Sequence[float] = (0.5, 0.9, 0.99)) -> dict[str, float | None]:
    """``{"p50": ms, ...}`` interpolated inside buckets (error < one bucket, ~19 %).

    None when there are no requests; ``inf`` when the quantile lies in the
    overflow bucket (over ~141 s).
    """
    h = _hist(buckets)
    out: dict[str, float | None] = {}
    for q in qs:
        key = "p" + (f"{q * 100:.10g}")
        out[key] = None if h.count == 0 else round(h.percentile(q), 3)
    return out


@dataclass(frozen=True)
class HistRow:
    lo_ms: float     # exclusive lower bound (0 for the first row)
    hi_ms: float     # inclusive upper bound (inf for the overflow row)
    count: int


def coarse_rows(buckets: Sequence[int]) -> list[HistRow]:
    """One row per doubling of latency, from the first to the last non-empty
    row (empty rows in between stay, so gaps in a bimodal load show)."""
    counts = list(buckets)[: len(BUCKET_UPPER_MS)]
    groups: dict[int, int] = {}
    for i, c in enumerate(counts):
        if c:
            g = -1 if i == _OVERFLOW else math.ceil(i / _PER_ROW)
            groups[g] = groups.get(g, 0) + c
    if not groups:
        return []
    finite = [g for g in groups if g >= 0]
    rows: list[HistRow] = []
    if finite:
        last_group = math.ceil((_OVERFLOW - 1) / _PER_ROW)
        for g in range(min(finite), max(finite) + 1):
            first = 0 if g == 0 else _PER_ROW * g - (_PER_ROW - 1)
            last = min(_PER_ROW * g, _OVERFLOW - 1) if g < last_group else _OVERFLOW - 1
            lo = 0.0 if first == 0 else BUCKET_UPPER_MS[first - 1]
            rows.append(HistRow(lo, BUCKET_UPPER_MS[last], groups.get(g, 0)))
    if -1 in groups:
        rows.append(HistRow(BUCKET_UPPER_MS[_OVERFLOW - 1], math.inf, groups[-1]))
    return rows


def fmt_ms(ms: float | None) -> str:
    """Short latency: 40µs, 1.3ms, 12ms, 2.6s; '-' for None."""
    if ms is None:
        return "-"
    if math.isinf(ms):
        return "inf"
    if ms < 1.0:
        return f"{ms * 1000:.0f}µs"
    if ms < 10.0:
        return f"{ms:.2f}ms"
    if ms < 1000.0:
        return f"{ms:.0f}ms" if ms >= 100 else f"{ms:.1f}ms"
    return f"{ms / 1000:.2f}s"


def _bar(frac: float, width: int) -> str:
    cells = max(0.0, min(1.0, frac)) * width
    full = int(cells)
    part = int((cells - full) * 8)
    s = "█" * full + (_BLOCKS[part] if part and full < width else "")
    return s.ljust(width)


def histogram_lines(buckets: Sequence[int], width: int = 30) -> list[str]:
    """Text rows: range, bar scaled to the largest row, count, percent, cumulative percent."""
    rows = coarse_rows(buckets)
    total = sum(r.count for r in rows)
    if not total:
        return ["(no requests)"]
    peak = max(r.count for r in rows)
    cw = len(str(peak))
    out = []
    cum = 0
    for r in rows:
        cum += r.count
        label = f"> {fmt_ms(r.lo_ms)}" if math.isinf(r.hi_ms) else f"{fmt_ms(r.lo_ms)}–{fmt_ms(r.hi_ms)}"
        out.append(f"{label:>15} │{_bar(r.count / peak, width)}│ {r.count:>{cw}} "
                   f"{100.0 * r.count / total:5.1f}% {100.0 * cum / total:6.1f}%")
    return out


# ----------------------------------------------------------------- status


@dataclass(frozen=True)
class SlotLatency:
    slot: int
    node: int | None
    pid: int | None
    state: str
    buckets: list[int]             # the counts shown (cumulative or the window)
    count: int
    pcts: dict[str, float | None]  # from the buckets
    recent: dict[str, float]       # the worker's own recent-window latency_ms
    windowed: bool
    problem: str | None = None     # e.g. an unknown bucket layout


def slot_latencies(snapshot: Mapping[str, Any], previous: Mapping[str, Any] | None = None) -> list[SlotLatency]:
    """Per-slot distributions from a ``status`` snapshot; with ``previous``
    (an earlier snapshot) only the requests between the two."""
    before = {s["slot"]: ((s.get("totals") or {}).get("latency_buckets") or [])
              for s in (previous or {}).get("slots", [])}
    out = []
    for s in snapshot.get("slots", []):
        cur = list((s.get("totals") or {}).get("latency_buckets") or [])
        problem = None
        if cur and len(cur) != len(BUCKET_UPPER_MS):
            problem = f"unknown bucket layout ({len(cur)} buckets, expected {len(BUCKET_UPPER_MS)})"
            cur = []
        windowed = previous is not None and s["slot"] in before
        counts = window(before[s["slot"]], cur) if windowed else cur
        out.append(SlotLatency(
            slot=s["slot"], node=s.get("node"), pid=s.get("pid"), state=s.get("state", "?"),
            buckets=counts, count=sum(counts), pcts=percentiles(counts),
            recent=dict(s.get("latency_ms") or {}), windowed=windowed, problem=problem,
        ))
    return out


def latency_summary(snapshot: Mapping[str, Any], previous: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """JSON-ready per-slot view for ``status --latency --json``."""
    return [{
        "slot": s.slot, "node": s.node, "pid": s.pid, "requests": s.count, "windowed": s.windowed,
        **{k: v for k, v in s.pcts.items()},
        "rows": [{"lo_ms": r.lo_ms, "hi_ms": None if math.isinf(r.hi_ms) else round(r.hi_ms, 4),
                  "count": r.count} for r in coarse_rows(s.buckets)],
        "problem": s.problem,
    } for s in slot_latencies(snapshot, previous)]


def _header(s: SlotLatency) -> str:
    scope = "in the window" if s.windowed else "since start"
    p = s.pcts
    head = (f"slot {s.slot} (node {s.node}, pid {s.pid or '-'}, {s.state}): {s.count} requests {scope}"
            f" — p50 {fmt_ms(p['p50'])}  p90 {fmt_ms(p['p90'])}  p99 {fmt_ms(p['p99'])}")
    if s.recent and s.recent.get("p50") is not None and any(s.recent.values()):
        head += (f"  (worker's recent window: p50 {fmt_ms(s.recent.get('p50'))}"
                 f" p99 {fmt_ms(s.recent.get('p99'))})")
    return head


def latency_text(snapshot: Mapping[str, Any], previous: Mapping[str, Any] | None = None,
                 width: int = 30) -> str:
    """Plain-text version of ``render_latency`` (logs, tests, non-rich callers)."""
    lines: list[str] = []
    for s in slot_latencies(snapshot, previous):
        lines.append(_header(s))
        if s.problem:
            lines.append(f"  {s.problem}")
        elif s.count:
            lines += ["  " + row for row in histogram_lines(s.buckets, width)]
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def render_latency(snapshot: Mapping[str, Any], previous: Mapping[str, Any] | None = None,
                   width: int = 30) -> Any:
    """A rich renderable: per slot a header with p50/p90/p99 and a bar histogram."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []
    for s in slot_latencies(snapshot, previous):
        parts.append(Text(_header(s), style="bold"))
        if s.problem:
            parts.append(Text(f"  {s.problem}", style="red"))
            continue
        rows = coarse_rows(s.buckets)
        if not rows:
            continue
        t = Table(show_edge=False, show_header=True, header_style="dim", box=None, padding=(0, 1))
        for col, just in (("latency", "right"), ("", "left"), ("count", "right"), ("%", "right"),
                          ("cum %", "right")):
            t.add_column(col, justify=just)  # type: ignore[arg-type]
        peak = max(r.count for r in rows)
        cum = 0
        for r in rows:
            cum += r.count
            label = f"> {fmt_ms(r.lo_ms)}" if math.isinf(r.hi_ms) else f"{fmt_ms(r.lo_ms)}–{fmt_ms(r.hi_ms)}"
            t.add_row(label, Text(_bar(r.count / peak, width), style="cyan"), str(r.count),
                      f"{100.0 * r.count / s.count:.1f}", f"{100.0 * cum / s.count:.1f}")
        parts.append(t)
    return Group(*parts)
