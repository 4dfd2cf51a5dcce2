"""Test app: the worker of slot LEAK_SLOT keeps ~100 KB per request (a leak);
every other worker fills a warm-up cache of ~30 MB over its first 300 requests,
then stays flat (a healthy worker that grows at first)."""

import json
import os

LEAK_SLOT = os.environ.get("LEAK_SLOT", "0")
KEPT: list[bytes] = []
CACHE: dict[int, bytes] = {}
N = 0


async def app(scope, receive, send):
    global N
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    N += 1
    slot = os.environ.get("NUMASERVE_SLOT")
    if slot == LEAK_SLOT:
        KEPT.append(os.urandom(100 * 1024))
    elif N <= 300:
        CACHE[N] = os.urandom(100 * 1024)
    body = json.dumps({"slot": int(slot), "pid": os.getpid(), "gen": int(os.environ["NUMASERVE_GENERATION"])}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})
