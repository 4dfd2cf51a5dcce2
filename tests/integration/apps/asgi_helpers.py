"""Shared bits of the test apps: the lifespan handshake and a JSON/text reply."""

import json


async def lifespan(scope, receive, send) -> bool:
    """Answer the lifespan protocol; True when ``scope`` was a lifespan scope."""
    if scope["type"] != "lifespan":
        return False
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return True


async def reply(send, body, content_type: bytes = b"application/json") -> None:
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
    await send({"type": "http.response.body", "body": data})
