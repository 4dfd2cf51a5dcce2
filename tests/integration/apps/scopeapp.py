"""Test app (plain ASGI): answers every request with what its scope says (path, root_path,
client, scheme); ``/sleep?ms=N`` answers after N milliseconds."""

import asyncio
import json
import os


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    qs = scope.get("query_string", b"").decode()
    if scope["path"].endswith("/sleep") and qs.startswith("ms="):
        await asyncio.sleep(int(qs[3:]) / 1000)
    body = json.dumps({
        "path": scope["path"], "root_path": scope.get("root_path", ""), "client": list(scope.get("client") or []),
        "scheme": scope.get("scheme"), "pid": os.getpid(),
    }).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
