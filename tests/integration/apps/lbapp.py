"""Test app for the load-balancer tests: the traffic shapes a fleet serves.

GET /            JSON: which instance (LB_INSTANCE), slot and pid answered
POST /v1/echo    reads the whole body, answers its length and a checksum
GET /stream      server-sent events: ``n`` events ``dt`` seconds apart (awaits
                 between chunks, like a token stream); the last one is ``done``
"""

import asyncio
import hashlib
import json
import os
from urllib.parse import parse_qs

from asgi_helpers import lifespan, reply

WHO = {"instance": os.environ.get("LB_INSTANCE", "?"), "slot": os.environ.get("NUMASERVE_SLOT"),
       "pid": os.getpid()}


async def _body(receive):
    chunks = []
    while True:
        msg = await receive()
        chunks.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return b"".join(chunks)


async def app(scope, receive, send):
    if await lifespan(scope, receive, send):
        return
    path = scope["path"]
    if path == "/v1/echo":
        data = await _body(receive)
        await reply(send, {**WHO, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    elif path == "/stream":
        q = parse_qs(scope.get("query_string", b"").decode())
        n, dt = int(q.get("n", ["10"])[0]), float(q.get("dt", ["0.05"])[0])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        for i in range(n):
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"data: {json.dumps({'i': i, **WHO})}\n\n".encode()})
            await asyncio.sleep(dt)
        await send({"type": "http.response.body", "body": b"data: done\n\n"})
    else:
        await reply(send, WHO)
