"""Guest app for warm templates: the preload hook allocates WARM_MB MiB (default 200)
in the node-1 template only (a few pages elsewhere) and touches every page, so the
weights are resident where the template is bound; GET / says who serves."""

import json
import os

WEIGHTS = None
PRELOAD_PID = None


def load() -> None:
    global WEIGHTS, PRELOAD_PID
    mb = int(os.environ.get("WARM_MB", "200")) if os.environ.get("NUMASERVE_NODE") == "1" else 1
    size = mb << 20
    buf = bytearray(size)
    for i in range(0, size, 4096):
        buf[i] = 1
    WEIGHTS = buf
    PRELOAD_PID = os.getpid()


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return
    body = json.dumps({"pid": os.getpid(), "preload_pid": PRELOAD_PID,
                       "weights_bytes": len(WEIGHTS) if WEIGHTS is not None else 0}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})
