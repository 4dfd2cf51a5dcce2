"""Test app: GET /sleep?s=X sleeps X seconds (async) then answers; GET /block blocks the loop."""

import asyncio
import os
import time
from urllib.parse import parse_qs


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    q = parse_qs(scope.get("query_string", b"").decode())
    if scope["path"] == "/sleep":
        await asyncio.sleep(float(q.get("s", ["1"])[0]))
    elif scope["path"] == "/block":
        time.sleep(float(q.get("s", ["5"])[0]))
    body = f"slot={os.environ.get('NUMASERVE_SLOT')} gen={os.environ.get('NUMASERVE_GENERATION')} pid={os.getpid()}".encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})
