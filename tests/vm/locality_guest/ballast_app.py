"""Guest app for the locality test: BALLAST_MB MiB (default 64) allocated and touched at import,
in the worker itself (exec'd workers), so most of its resident memory is this buffer on its node."""

import json
import os

_SIZE = int(os.environ.get("BALLAST_MB", "64")) << 20
BALLAST = bytearray(_SIZE)
for _i in range(0, _SIZE, 4096):
    BALLAST[_i] = 1


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return
    body = json.dumps({"pid": os.getpid(), "ballast_bytes": len(BALLAST)}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})
