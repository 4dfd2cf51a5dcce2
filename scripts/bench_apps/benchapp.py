"""The one app every server in the benchmark runs (pure ASGI 3, no framework).

Identical bytes for numaserve, ``uvicorn --workers N`` and gunicorn with
uvicorn workers, so any difference measured is the server's, not the app's.

Routes (all GET, all answer JSON with the worker's pid so a client can count
requests per worker without asking the server):

- ``/``            tiny response (~20 bytes): measures per-request overhead.
- ``/cpu?ms=N``    burns N ms of *CPU time* (``time.thread_time``) in the
                   handler without yielding, like a synchronous model call;
                   CPU time rather than wall time so a busy shared machine
                   does not change the amount of work, only how long it takes.
- ``/cpu5``, ``/cpu20``  the same with N fixed at 5 and 20 (no query parsing).
- ``/sse100``      a server-sent-event stream of 100 small events sent back to
                   back (chunked encoding): measures per-chunk overhead.
- ``/cpu?ms=N&yield_ms=Y``, ``/cpu20y``  the same work in slices of Y ms
                   (``/cpu20y``: 20 ms in 5 ms slices) with an
                   ``await asyncio.sleep(0)`` between them, like an async
                   inference loop that yields per batch of tokens (the
                   numaserve demo app does this): concurrent requests then
                   share the worker and an in-worker admission gate sees them.

Counting (only when the environment asks for it, so normal runs pay nothing):
``BENCH_COUNT_DIR=DIR`` makes each worker write ``DIR/<pid>.json`` with its
request count every 0.2 s (and at shutdown), and ``BENCH_COUNT_CPU=1`` also
counts on which CPU each request was handled (read from /proc/self/stat).
Files rather than an endpoint because a request for "your count" lands on an
arbitrary worker.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any, Awaitable, Callable, MutableMapping

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

MAX_CPU_MS = 1000.0
_COUNT_DIR = os.environ.get("BENCH_COUNT_DIR") or None
_COUNT_CPU = os.environ.get("BENCH_COUNT_CPU") == "1"
_counts: dict[str, Any] = {"requests": 0, "cpus": {}}
_flusher: asyncio.Task[None] | None = None


def burn(ms: float) -> None:
    """Spin until this thread has used ``ms`` milliseconds of CPU."""
    end = time.thread_time() + ms / 1000.0
    x = 1
    while time.thread_time() < end:
        for _ in range(200):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def current_cpu() -> int:
    """The CPU this thread runs on now (field 39 of /proc/thread-self/stat)."""
    with open("/proc/thread-self/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[36])


def _flush() -> None:
    if _COUNT_DIR is None:
        return
    pid = os.getpid()
    tmp = os.path.join(_COUNT_DIR, f".{pid}.tmp")
    with open(tmp, "w") as f:
        json.dump({"pid": pid, **_counts}, f)
    os.replace(tmp, os.path.join(_COUNT_DIR, f"{pid}.json"))


async def _flush_loop() -> None:
    while True:
        await asyncio.sleep(0.2)
        _flush()


def _count() -> None:
    _counts["requests"] += 1
    if _COUNT_CPU:
        cpu = str(current_cpu())
        _counts["cpus"][cpu] = _counts["cpus"].get(cpu, 0) + 1
    global _flusher
    if _flusher is None:  # lifespan is optional for some servers: start on first request too
        _flusher = asyncio.get_running_loop().create_task(_flush_loop())


def _cpu_ms(scope: Scope) -> tuple[float, float] | None:
    """(CPU ms, yield every ms or 0) for a /cpu route, None for anything else."""
    path = scope["path"]
    if path == "/cpu5":
        return 5.0, 0.0
    if path == "/cpu20":
        return 20.0, 0.0
    if path == "/cpu20y":
        return 20.0, 5.0
    if path != "/cpu":
        return None
    ms = slice_ms = 0.0
    for part in scope.get("query_string", b"").decode("latin-1").split("&"):
        name, _, value = part.partition("=")
        try:
            if name == "ms":
                ms = min(max(float(value), 0.0), MAX_CPU_MS)
            elif name == "yield_ms":
                slice_ms = max(float(value), 0.0)
        except ValueError:
            return None
    return ms, slice_ms


async def _respond(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _lifespan(receive: Receive, send: Send) -> None:
    global _flusher
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            if _COUNT_DIR is not None and _flusher is None:
                _flusher = asyncio.get_running_loop().create_task(_flush_loop())
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            _flush()
            await send({"type": "lifespan.shutdown.complete"})
            return


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """ASGI 3 entry point."""
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    if scope["type"] != "http":
        return
    path = scope["path"]
    if _COUNT_DIR is not None:
        _count()
    if path == "/":
        await _respond(send, 200, b'{"pid":%d}' % os.getpid())
        return
    if path == "/sse100":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        for i in range(100):
            await send({"type": "http.response.body", "body": b"data: {\"token\": %d}\n\n" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    work = _cpu_ms(scope)
    if work is None:
        await _respond(send, 404, b'{"error":"not found"}')
        return
    ms, slice_ms = work
    if slice_ms > 0:
        left = ms
        while left > 0:
            burn(min(slice_ms, left))
            left -= slice_ms
            if left > 0:
                await asyncio.sleep(0)
    else:
        burn(ms)
    await _respond(send, 200, b'{"pid":%d,"ms":%g}' % (os.getpid(), ms))
