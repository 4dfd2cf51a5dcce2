"""A FastAPI app with the traffic an inference service lives on (bench and integration tests).

Identical for numaserve, ``uvicorn --workers N`` and gunicorn + UvicornWorker.

- ``GET /``                       tiny JSON with the pid.
- ``GET /await?s=1``              awaits I/O (``asyncio.sleep``) for s seconds, then answers.
- ``GET /sse?n=20&gap=0.05``      a server-sent-event stream: n events, gap seconds apart.
- ``GET /stream?s=20&gap=1``      a long stream: one event every gap seconds for s seconds.
- ``POST /upload``                reads the whole body (however slowly it comes), answers its size.
- ``GET /cpu20``                  20 ms of CPU in one synchronous call inside ``async def`` (blocks the loop).
- ``GET /cpu20y``                 20 ms of CPU in 5 ms slices, yielding between them (cooperative).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

from benchapp import burn  # the same 20 ms of CPU as the pure-ASGI bench app
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

app = FastAPI()
@app.get("/")
async def root() -> dict[str, int]:
    return {"pid": os.getpid()}


@app.get("/await")
async def wait(s: float = 1.0) -> dict[str, float]:
    await asyncio.sleep(min(max(s, 0.0), 60.0))
    return {"slept": s}


async def _events(n: int, gap: float) -> AsyncIterator[bytes]:
    for i in range(n):
        if i:
            await asyncio.sleep(gap)
        yield f"data: {{\"i\": {i}, \"pid\": {os.getpid()}}}\n\n".encode()


@app.get("/sse")
async def sse(n: int = 20, gap: float = 0.05) -> StreamingResponse:
    return StreamingResponse(_events(min(n, 10_000), max(gap, 0.0)), media_type="text/event-stream")


@app.get("/stream")
async def stream(s: float = 20.0, gap: float = 1.0) -> StreamingResponse:
    gap = max(gap, 0.01)
    return StreamingResponse(_events(int(s / gap) + 1, gap), media_type="text/event-stream")


@app.post("/upload")
async def upload(request: Request) -> dict[str, int]:
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
    return {"bytes": size}


@app.get("/cpu20")
async def cpu20() -> dict[str, int]:
    burn(20.0)
    return {"pid": os.getpid(), "ms": 20}


@app.get("/cpu20y")
async def cpu20y() -> dict[str, int]:
    for i in range(4):
        burn(5.0)
        if i < 3:
            await asyncio.sleep(0)
    return {"pid": os.getpid(), "ms": 20}
