"""The app ``scripts/hostile_compare.py`` serves with numaserve and uvicorn alike.

numaserve's demo app (``numaserve.apps.demo``: ``/``, ``/healthz``, the OpenAI
routes and their JSON parsing), plus ``/stream?N``: a response of N chunks of
1 MiB (what a client may fetch through a frame), and ``/sleep``: answers after
0.3 s without reading the body (requests pile up behind it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from numaserve.apps import demo

_CHUNK = b"s" * (1 << 20)


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "http" and scope["path"] == "/stream":
        n = min(int(scope["query_string"] or b"1"), 1024)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for _ in range(n):
            await send({"type": "http.response.body", "body": _CHUNK, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    if scope["type"] == "http" and scope["path"] == "/sleep":
        await asyncio.sleep(0.3)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    await demo.app(scope, receive, send)
