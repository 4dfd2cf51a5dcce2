"""Test app: reports how many objects gc.freeze() moved to the permanent generation."""

import gc
import json

from asgi_helpers import lifespan, reply


async def app(scope, receive, send):
    if await lifespan(scope, receive, send):
        return
    body = json.dumps({"freeze_count": gc.get_freeze_count()}).encode()
    await reply(send, body, b"application/json")
