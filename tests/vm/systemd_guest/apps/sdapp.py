"""App the systemd VM tests serve (copied to a world-readable directory in the guest).

GET /            {"pid", "node"}
GET /slow?s=F    replies after F seconds (an await: in flight during reload and stop)
GET /alloc?mb=N  allocates and touches N MiB more, kept (drives a worker into MemoryMax)
Two helper threads start with the app (at lifespan startup, in the worker: threads started at
import would make the node's template refuse to fork, and every worker would be exec'd, the
slow path), so "every thread is pinned" covers more than the main thread.
"""

import asyncio
import json
import os
import threading
import time
from urllib.parse import parse_qs

HELD: list[bytearray] = []


def _idle() -> None:
    while True:
        time.sleep(3600)


def _start_helpers() -> None:
    for _ in range(2):
        threading.Thread(target=_idle, daemon=True, name="sdapp-helper").start()


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                _start_helpers()
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    q = parse_qs(scope.get("query_string", b"").decode())
    path = scope.get("path", "/")
    if path == "/slow":
        await asyncio.sleep(float(q.get("s", ["1"])[0]))
    elif path == "/alloc":
        buf = bytearray(int(q.get("mb", ["0"])[0]) << 20)
        buf[::4096] = b"\x01" * len(range(0, len(buf), 4096))
        HELD.append(buf)
    body = json.dumps({"pid": os.getpid(), "node": int(os.environ.get("NUMASERVE_NODE", "-1")),
                       "path": path}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})
