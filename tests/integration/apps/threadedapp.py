"""Test app that starts a thread at import (as a metrics exporter or a BLAS pool would):
a template that imported it must refuse to fork."""

import os
import threading
import time

from asgi_helpers import lifespan, reply


def _poll() -> None:
    while True:
        time.sleep(1.0)


threading.Thread(target=_poll, name="app-poller", daemon=True).start()


async def app(scope, receive, send):
    if await lifespan(scope, receive, send):
        return
    await reply(send, {"pid": os.getpid(), "threads": threading.active_count()})
