"""Test app (FastAPI) for warm templates: who imported it, what the preload hook left,
and an SSE token stream.

``load()`` is the preload hook: it allocates TEMPLATEAPP_PRELOAD_MB MiB (default 4),
touches every page (so they are resident where the hook ran), and records the pid
it ran in.  GET / reports that pid beside the serving worker's own.
"""

import asyncio
import os

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

IMPORTED_BY = os.getpid()
WEIGHTS: bytearray | None = None
PRELOAD_PID: int | None = None


def load() -> None:
    global WEIGHTS, PRELOAD_PID
    size = int(float(os.environ.get("TEMPLATEAPP_PRELOAD_MB", "4")) * (1 << 20))
    buf = bytearray(size)
    for i in range(0, size, 4096):
        buf[i] = 1  # resident now, on the node this process is bound to
    WEIGHTS = buf
    PRELOAD_PID = os.getpid()


app = FastAPI()


@app.get("/")
async def root():
    return {
        "pid": os.getpid(), "ppid": os.getppid(), "imported_by": IMPORTED_BY, "preload_pid": PRELOAD_PID,
        "weights_bytes": len(WEIGHTS) if WEIGHTS is not None else 0,
        "slot": os.environ.get("NUMASERVE_SLOT"), "cpus": sorted(os.sched_getaffinity(0)),
    }


@app.get("/sse")
async def sse(n: int = 5):
    async def tokens():
        for i in range(n):
            await asyncio.sleep(0.02)
            yield f"data: token-{i} pid={os.getpid()}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(tokens(), media_type="text/event-stream")


@app.get("/env")
async def env(names: str = ""):
    return {"pid": os.getpid(), "env": {n: os.environ.get(n) for n in names.split(",") if n}}
