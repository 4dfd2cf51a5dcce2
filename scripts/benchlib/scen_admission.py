"""Scenario "admission" (issue 13): traffic that uses no CPU must never be refused.

A FastAPI app (``bench_apps/fastapp.py``), 2 workers, default config, real
httpx clients, side by side with uvicorn and gunicorn:

- ``awaits``   N concurrent requests that each ``await asyncio.sleep(1)``;
- ``sse``      N concurrent server-sent-event streams (20 events, 50 ms apart);
- ``streams``  N concurrent long streams (one event a second for S seconds);
- ``uploads``  U clients trickling a 100 kB upload at 2 bytes/s while one
  client sends ordinary ``GET /`` requests back to back: the share of those
  refused (503) is what counts.

Each row: how many were served completely, how many refused (503), how many
failed otherwise.  Target: 0 refused (uploads: < 1 % of the ordinary traffic).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from benchlib.common import Ctx
from benchlib.servers import Server, ServerConfig

APP = "fastapp:app"


def _limits() -> Any:
    import httpx

    return httpx.Limits(max_connections=2000, max_keepalive_connections=2000)


async def _get_all(base: str, path: str, n: int) -> Counter[str]:
    import httpx

    async with httpx.AsyncClient(timeout=60.0, limits=_limits()) as c:
        rs = await asyncio.gather(*(c.get(base + path) for _ in range(n)), return_exceptions=True)
    return Counter(str(r.status_code) if isinstance(r, httpx.Response) else type(r).__name__ for r in rs)


async def _streams(base: str, path: str, n: int, events: int) -> Counter[str]:
    import httpx

    async def one(c: httpx.AsyncClient) -> str:
        got = 0
        try:
            async with c.stream("GET", base + path) as r:
                if r.status_code != 200:
                    return str(r.status_code)
                async for line in r.aiter_lines():
                    got += line.startswith("data:")
        except httpx.HTTPError as e:
            return type(e).__name__
        return "200" if got >= events else f"short ({got}/{events} events)"

    async with httpx.AsyncClient(timeout=120.0, limits=_limits()) as c:
        return Counter(await asyncio.gather(*(one(c) for _ in range(n))))


async def _trickle(seconds: float) -> AsyncIterator[bytes]:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        yield b"xx"
        await asyncio.sleep(1.0)


async def _uploads(base: str, uploads: int, gets: int) -> tuple[Counter[str], int]:
    """Ordinary GETs (statuses) while ``uploads`` slow uploads are in progress (how many still were)."""
    import httpx

    async with httpx.AsyncClient(timeout=120.0, limits=_limits()) as c:
        slow = [asyncio.ensure_future(c.post(base + "/upload", content=_trickle(3600),
                                             headers={"content-length": "100000"})) for _ in range(uploads)]
        await asyncio.sleep(1.0)
        statuses: Counter[str] = Counter()
        async with httpx.AsyncClient(timeout=30.0) as g:
            for _ in range(gets):
                try:
                    statuses[str((await g.get(base + "/")).status_code)] += 1
                except httpx.HTTPError as e:
                    statuses[type(e).__name__] += 1
        in_progress = sum(1 for t in slow if not t.done())
        for t in slow:
            t.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
    return statuses, in_progress


def _row(name: str, sent: int, statuses: Counter[str], **extra: Any) -> dict[str, Any]:
    ok = statuses.get("200", 0)
    refused = statuses.get("503", 0)
    return {"case": name, "sent": sent, "served": ok, "refused_503": refused,
            "refused_share": round(refused / sent, 4) if sent else None,
            "other": {k: v for k, v in statuses.items() if k not in ("200", "503")}, **extra}


def one_server(ctx: Ctx, kind: str) -> list[dict[str, Any]]:
    n_aw, n_sse, n_st, st_s = ctx.pick((40, 40, 60, 3.0), (40, 40, 200, 20.0))
    n_up, n_get = ctx.pick((10, 100), (20, 300))
    with Server(ServerConfig(kind, workers=2, app=APP)).start() as srv:
        srv.wait_ready()
        base = srv.url
        asyncio.run(_get_all(base, "/", 20))   # warm every worker's import caches
        rows = []
        t = time.perf_counter()
        rows.append(_row(f"{n_aw} concurrent 1 s awaits", n_aw, asyncio.run(_get_all(base, "/await?s=1", n_aw)),
                         seconds=round(time.perf_counter() - t, 2)))
        t = time.perf_counter()
        rows.append(_row(f"{n_sse} concurrent SSE streams (20 events, 50 ms)", n_sse,
                         asyncio.run(_streams(base, "/sse?n=20&gap=0.05", n_sse, 20)),
                         seconds=round(time.perf_counter() - t, 2)))
        t = time.perf_counter()
        events = int(st_s) + 1
        rows.append(_row(f"{n_st} concurrent {st_s:g} s streams", n_st,
                         asyncio.run(_streams(base, f"/stream?s={st_s:g}&gap=1", n_st, events)),
                         seconds=round(time.perf_counter() - t, 2)))
        statuses, still = asyncio.run(_uploads(base, n_up, n_get))
        rows.append(_row(f"{n_get} GETs beside {n_up} slow uploads (2 B/s)", n_get, statuses,
                         uploads_in_progress_at_end=still))
    for r in rows:
        r["server"] = kind
    return rows


def run(ctx: Ctx) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for kind in ctx.order(0):
        got = one_server(ctx, kind)
        for r in got:
            ctx.log(f"admission {kind:9} {r['case']}: served {r['served']}/{r['sent']}, 503 {r['refused_503']}, "
                    f"other {r['other']}")
        rows += got
    return {
        "title": "Admission: traffic that uses no CPU (FastAPI app, 2 workers, default config)",
        "params": {"app": APP, "workers": 2, "client": "httpx", "target": "0 refused; uploads: < 1 % of GETs"},
        "rows": rows,
        "targets": [{"server": r["server"], "case": r["case"], "refused": r["refused_503"],
                     "met": (r["refused_share"] or 0) < 0.01 if "GETs" in r["case"] else r["refused_503"] == 0}
                    for r in rows if r["server"] == "numaserve"],
    }
