"""Test app: GET /sleep?s=X sleeps X seconds (async) then answers; GET /block blocks the loop."""

import asyncio
import os
import time
from urllib.parse import parse_qs

from asgi_helpers import lifespan, reply


async def app(scope, receive, send):
    if await lifespan(scope, receive, send):
        return
    q = parse_qs(scope.get("query_string", b"").decode())
    if scope["path"] == "/sleep":
        await asyncio.sleep(float(q.get("s", ["1"])[0]))
    elif scope["path"] == "/block":
        time.sleep(float(q.get("s", ["5"])[0]))
    body = f"slot={os.environ.get('NUMASERVE_SLOT')} gen={os.environ.get('NUMASERVE_GENERATION')} pid={os.getpid()}".encode()
    await reply(send, body, b"text/plain")
