"""Test app: the slot named by BOOTFAIL_SLOT fails to import after BOOTFAIL_DELAY seconds
(an app that cannot start on one node) -- while the file BOOTFAIL_FILE exists, when that
is set; the other slots serve ``slot N``."""

import os
import time

from asgi_helpers import lifespan, reply

_marker = os.environ.get("BOOTFAIL_FILE")
if os.environ.get("NUMASERVE_SLOT") == os.environ.get("BOOTFAIL_SLOT", "1") and (
        not _marker or os.path.exists(_marker)):
    time.sleep(float(os.environ.get("BOOTFAIL_DELAY", "1.0")))
    raise RuntimeError("bootfail: this slot cannot start here")


async def app(scope, receive, send):
    if await lifespan(scope, receive, send):
        return
    await reply(send, f"slot {os.environ.get('NUMASERVE_SLOT')}".encode(), b"text/plain")
