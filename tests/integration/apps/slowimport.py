"""Test app: importing it takes SLOWIMPORT_S seconds from the second generation on
(a reload onto code that loads a model at import); answers its pid and generation."""

import os
import time

from asgi_helpers import lifespan, reply

if int(os.environ.get("NUMASERVE_GENERATION", "1")) > 1:
    time.sleep(float(os.environ.get("SLOWIMPORT_S", "5")))


async def app(scope, receive, send):
    if await lifespan(scope, receive, send):
        return
    await reply(send, {"pid": os.getpid(), "generation": int(os.environ.get("NUMASERVE_GENERATION", "0"))})
