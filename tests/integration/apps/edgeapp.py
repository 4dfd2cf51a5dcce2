"""Test app (FastAPI): an upload endpoint, a websocket echo, and a lifespan that
opens EDGEAPP_MODEL_PATH when it is set (a missing file fails the startup) —
in every slot, or only in slot EDGEAPP_FAIL_SLOT when that is set."""

import os
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect


@asynccontextmanager
async def lifespan(app):
    path = os.environ.get("EDGEAPP_MODEL_PATH")
    only = os.environ.get("EDGEAPP_FAIL_SLOT")
    if path and (only is None or only == os.environ.get("NUMASERVE_SLOT")):
        with open(path, "rb"):
            pass
    yield


app = FastAPI(lifespan=lifespan)


@app.post("/upload")
async def upload(request: Request):
    body = await request.body()
    return {"bytes": len(body), "pid": os.getpid()}


@app.websocket("/ws")
async def echo(ws: WebSocket):
    await ws.accept()
    try:
        while True:
            text = await ws.receive_text()
            await ws.send_json({"echo": text, "pid": os.getpid()})
    except WebSocketDisconnect as e:
        print(f"edgeapp: websocket disconnect code {e.code}", flush=True)
