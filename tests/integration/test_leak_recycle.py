"""Leak recycling end to end: a worker leaking ~100 KB per request is recycled
(readiness-gated, zero failed requests); a worker whose cache warms up is not."""

from __future__ import annotations

import os
import time

import pytest

from tests.integration.harness import APPS, FAST_CONFIG, Running
from tests.integration.load import LoadLoop

pytestmark = pytest.mark.slow

# Scaled-down detector (the production tuning needs thousands of requests): the
# fixed tuning is replaced in the supervisor by apps/leaktuning/sitecustomize.py
# (grace 200 requests / 2 s, steps of 20, evaluation every 100 requests or 1 s,
# no time axis, recycle spacing off); the window is the [leak] key.
TUNING = APPS / "leaktuning"
LEAK_CONFIG = FAST_CONFIG + """
[leak]
window_requests = 1000
[admission]
enabled = true
"""


def tuned_env() -> dict[str, str]:
    """The leaking app's slot, and the scaled-down detector first on the path."""
    path = [str(TUNING)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"LEAK_SLOT": "0", "PYTHONPATH": os.pathsep.join(path)}


def test_leaking_worker_is_recycled_and_warming_cache_is_not() -> None:
    with Running(["--nodes", "0", "--workers-per-node", "2", "--app", "leakapp:app", "--bind", "127.0.0.1:0"],
                 config=LEAK_CONFIG, env=tuned_env()) as sup:
        with LoadLoop(sup.port, keepalive=2, fresh=2, max_seconds=90, max_requests=5000, pace=0.02) as load:
            st = sup.wait_for(lambda st: any(o["kind"] == "leak" and o["state"] == "succeeded"
                                             for o in st["operations"]), 90, "the leaking slot recycled")
            time.sleep(1.0)
        res = load.stop()
        assert not res.failures, res.failures[:10]
        s0, s1 = st["slots"]
        assert s1["generation"] == 1, s1                       # the warming cache was not recycled
        hist = s0["memory"]["history"] or []
        ops = [o for o in st["operations"] if o["kind"] == "leak"]
        assert ops and ops[-1]["slots"] == [0], st["operations"]
        assert s0["restarts"] == 0                             # a recycle, not a crash
        assert s0["totals"]["restarts_by_reason"].get("leak") == 1, s0["totals"]
        # the verdict that recycled it is kept with its evidence
        assert any(h["kind"] == "leak" and h["evidence"]["slope_per_1000_requests"] > 50e6 for h in hist), hist
        final = sup.status()
        assert final["slots"][1]["memory"]["verdict"] in ("ok", "warming"), final["slots"][1]["memory"]
        events = [e for e in sup.events() if e.get("event") == "leak_verdict"]
        assert events and all(e["slot"] == 0 for e in events if e["verdict"] == "leak")
