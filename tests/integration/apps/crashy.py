"""Test app: crashes (os._exit) shortly after start-up in the slot named by CRASHY_SLOT."""

import asyncio
import os


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                if os.environ.get("NUMASERVE_SLOT") == os.environ.get("CRASHY_SLOT", "1"):
                    asyncio.get_running_loop().call_later(0.3, os._exit, 7)
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = f"slot {os.environ.get('NUMASERVE_SLOT')}".encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body})
