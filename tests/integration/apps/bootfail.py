"""Test app: the slot named by BOOTFAIL_SLOT fails to import after BOOTFAIL_DELAY seconds
(an app that cannot start on one node); the other slots serve ``slot N``."""

import os
import time

from asgi_helpers import lifespan, reply

if os.environ.get("NUMASERVE_SLOT") == os.environ.get("BOOTFAIL_SLOT", "1"):
    time.sleep(float(os.environ.get("BOOTFAIL_DELAY", "1.0")))
    raise RuntimeError("bootfail: this slot cannot start here")


async def app(scope, receive, send):
    if await lifespan(scope, receive, send):
        return
    await reply(send, f"slot {os.environ.get('NUMASERVE_SLOT')}".encode(), b"text/plain")
