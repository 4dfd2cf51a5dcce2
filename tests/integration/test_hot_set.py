"""More workers than CPUs: the real supervisor sends new connections to a hot set of as many
workers as the node has CPUs, and spills to the others when a hot worker stalls (a handler
that blocks its event loop), so blocked workers do not keep taking new connections."""

from __future__ import annotations

import asyncio
import os
import re

import httpx
import pytest

from tests.integration.harness import Running

pytestmark = pytest.mark.slow

CPUS = len(os.sched_getaffinity(0))
WORKERS = 2 * CPUS
needs_few_cpus = pytest.mark.skipif(WORKERS > 8, reason=f"{CPUS} CPUs: a crowded node needs {WORKERS} workers")


def hot(sup: Running) -> dict:
    st = sup.status()["supervisor"]["steering"]
    assert st["hot_set"] is not None, st
    return st["hot_set"]


async def _served_by(base: str, n: int, path: str = "/") -> list[tuple[int, int | None]]:
    """(status, slot) of ``n`` requests, each on a new connection."""
    out = []
    for _ in range(n):
        async with httpx.AsyncClient(timeout=20.0) as c:
            r = await c.get(base + path)
            m = re.search(r"slot=(\d+)", r.text)
            out.append((r.status_code, int(m.group(1)) if m else None))
    return out


@needs_few_cpus
def test_new_connections_go_to_the_hot_set_and_spill_when_a_hot_worker_stalls() -> None:
    args = ["--nodes", "0", "--workers-per-node", str(WORKERS), "--bind", "127.0.0.1:0", "--app", "slowapp:app"]
    with Running(args) as sup:
        base = f"http://127.0.0.1:{sup.port}"
        hs = sup.wait_for(lambda s: (s["supervisor"]["steering"]["hot_set"] or {}).get("slots"), 30,
                          "a hot set")["supervisor"]["steering"]["hot_set"]
        first = set(hs["slots"])
        assert len(first) == hs["cpus"]["0"] <= CPUS < WORKERS, hs
        got = asyncio.run(_served_by(base, 30))
        assert {s for s, _ in got} == {200}
        assert {slot for _, slot in got} <= first, got   # nothing reached the others

        async def stall() -> list[int]:
            async with httpx.AsyncClient(timeout=30.0) as c:
                # short enough that a worker holding all of them stays under the heartbeat timeout
                blocks = [asyncio.create_task(c.get(base + "/block?s=0.8")) for _ in range(len(first) + 1)]
                await asyncio.sleep(0.3)   # the hot workers' loops are blocked now
                waiting = await asyncio.gather(*(_served_by(base, 1) for _ in range(6 * len(first))))
                done = await asyncio.gather(*blocks)
                return [r.status_code for r in done] + [s for w in waiting for s, _ in w]

        codes = asyncio.run(stall())
        assert set(codes) <= {200, 503}, codes
        # the stalled hot workers stopped taking new connections (out of the set while silent, or
        # the set spilled on their sentinels' 503s), and the set did not come back onto them
        st = sup.wait_for(lambda s: s["supervisor"]["steering"]["hot_set"]["spills"] >= 1
                          or set(s["supervisor"]["steering"]["hot_set"]["slots"]) != first, 20, "a moved hot set")
        moved = st["supervisor"]["steering"]["hot_set"]
        got = asyncio.run(_served_by(base, 30))
        assert {s for s, _ in got} == {200}
        now = set(hot(sup)["slots"])
        assert {slot for _, slot in got} <= now, (got, moved, now)


@needs_few_cpus
def test_concentrate_off_spreads_over_every_worker() -> None:
    args = ["--nodes", "0", "--workers-per-node", str(WORKERS), "--bind", "127.0.0.1:0", "--app", "slowapp:app"]
    from tests.integration.harness import FAST_CONFIG

    with Running(args, config=FAST_CONFIG.replace("[server]\n", "[server]\nconcentrate = false\n")) as sup:
        st = sup.status()["supervisor"]["steering"]
        assert st["hot_set"] is None and st["program_attached"] is False, st
