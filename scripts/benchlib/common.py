"""Shared pieces: the run context (mode, repetitions, bounds), the median and
spread of repeated measurements, and the order servers run in."""

from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from benchlib.servers import KINDS


@dataclass
class Ctx:
    """One bench invocation: how big, how often, and where results go."""

    quick: bool
    reps: int
    out: Path
    servers: tuple[str, ...] = KINDS
    seed: int = 1
    base: Path | None = None      # numaserve source tree to run beside ours (overload-sweep's before/after)
    t0: float = field(default_factory=time.monotonic)
    notes: list[str] = field(default_factory=list)

    def pick(self, quick: Any, full: Any) -> Any:
        """The quick-mode or the full-mode value of a parameter."""
        return quick if self.quick else full

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    def order(self, rep: int) -> list[str]:
        """Servers in a different order each repetition, so a slow spell on the
        shared machine does not always hit the same server."""
        kinds = list(self.servers)
        random.Random(self.seed * 1000 + rep).shuffle(kinds)
        return kinds


def summarize(values: Iterable[float | None]) -> dict[str, Any]:
    """Median, min, max and count of the non-missing values (None when none)."""
    v = [float(x) for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": round(statistics.median(v), 4), "min": round(min(v), 4), "max": round(max(v), 4),
            "n": len(v)}


def summarize_rows(reps: Sequence[dict[str, Any]], keys: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``summarize`` per key over the repetitions' dicts."""
    return {k: summarize(r.get(k) for r in reps) for k in keys}


def fmt(s: dict[str, Any] | None, digits: int = 1, spread: bool = True) -> str:
    """``median (min–max)`` for a markdown cell."""
    if not s or s.get("median") is None:
        return "–"
    f = f"{{:.{digits}f}}"
    med = f.format(s["median"])
    if not spread or s["n"] < 2 or s["min"] == s["max"]:
        return med
    return f"{med} ({f.format(s['min'])}–{f.format(s['max'])})"
