"""Test app: the worker of slot LEAK_SLOT keeps ~100 KB per request (a leak);
every other worker fills a warm-up cache of ~30 MB over its first 300 requests,
then stays flat (a healthy worker that grows at first)."""

import json
import os

from asgi_helpers import lifespan, reply

LEAK_SLOT = os.environ.get("LEAK_SLOT", "0")
KEPT: list[bytes] = []
CACHE: dict[int, bytes] = {}
N = 0



async def app(scope, receive, send):
    global N
    if await lifespan(scope, receive, send):
        return
    N += 1
    slot = os.environ.get("NUMASERVE_SLOT")
    if slot == LEAK_SLOT:
        KEPT.append(os.urandom(100 * 1024))
    elif N <= 300:
        CACHE[N] = os.urandom(100 * 1024)
    body = json.dumps({"slot": int(slot), "pid": os.getpid(), "gen": int(os.environ["NUMASERVE_GENERATION"])}).encode()
    await reply(send, body, b"application/json")
