"""server.lb_grace: the decision (pure) and the /readyz probe clock the admin app feeds."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from numaserve.config import ConfigError, load_config
from numaserve.supervisor.admin import LoopHeartbeat, build_app
from numaserve.supervisor.lbgrace import (
    WATCH_WINDOW_MIN_S,
    ProbeClock,
    decide_lb_grace,
    watch_window,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_grace_is_spent_only_while_a_balancer_watches() -> None:
    assert decide_lb_grace(5.0, 0.5).seconds == 5.0
    assert decide_lb_grace(5.0, WATCH_WINDOW_MIN_S - 1).seconds == 5.0
    d = decide_lb_grace(5.0, WATCH_WINDOW_MIN_S + 1)
    assert d.seconds == 0 and "no balancer is watching" in d.reason
    d = decide_lb_grace(5.0, None)
    assert d.seconds == 0 and "never requested" in d.reason
    d = decide_lb_grace(0.0, 0.1)
    assert d.seconds == 0 and d.reason == "server.lb_grace = 0"


def test_watch_window_grows_with_long_graces() -> None:
    # a balancer needing 60 s to notice probes at least every 60 s: a probe 150 s ago still counts
    assert watch_window(5.0) == WATCH_WINDOW_MIN_S
    assert watch_window(60.0) == 180.0
    assert decide_lb_grace(60.0, 150.0).seconds == 60.0
    assert decide_lb_grace(60.0, 181.0).seconds == 0


def test_probe_clock() -> None:
    clock = Clock()
    p = ProbeClock(clock)
    assert p.age() is None
    p.seen()
    clock.t += 7.5
    assert p.age() == 7.5 and p.count == 1


class FakeSup:
    stopping = False
    state = "running"

    def __init__(self) -> None:
        self.readyz_probes = ProbeClock()

    def status(self) -> dict[str, Any]:
        return {"supervisor": {"state": self.state}, "slots": [{"slot": 0, "node": 0, "state": "ready"}]}


def test_admin_app_notes_every_readyz_request_and_nothing_else() -> None:
    async def run() -> None:
        sup = FakeSup()
        app = build_app(sup, LoopHeartbeat(), stale_after=5.0, cpu_node={})
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin") as c:
            await c.get("/metrics")
            await c.get("/healthz")
            assert sup.readyz_probes.count == 0
            assert (await c.get("/readyz")).status_code == 200
            assert (await c.head("/readyz")).status_code == 200   # a HEAD probe counts too
            sup.stopping = True
            r = await c.get("/readyz")
            assert r.status_code == 503 and r.json()["reason"] == "stopping"
            assert sup.readyz_probes.count == 3

    asyncio.run(run())


def test_lb_grace_config_key(tmp_path: Any) -> None:
    assert load_config(None, {}, environ={}, use_default_path=False).server.lb_grace == 5.0
    f = tmp_path / "c.toml"
    f.write_text("[server]\nlb_grace = 0\n")
    assert load_config(str(f), {}, environ={}).server.lb_grace == 0
    f.write_text("[server]\nlb_grace = -1\n")
    with pytest.raises(ConfigError, match=r"server\.lb_grace = -1.*>= 0"):
        load_config(str(f), {}, environ={})
