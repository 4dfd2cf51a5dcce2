"""Shared by the worker unit tests: start a real WorkerServer on a dup of a listener."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any


async def start_serving(server: Any, lst: socket.socket) -> "asyncio.Task[None]":
    """``server.serve`` on a dup of ``lst`` in a task; returns once it has started (asserted)."""
    sock = socket.socket(fileno=os.dup(lst.fileno()))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    for _ in range(200):
        if server.started:
            break
        await asyncio.sleep(0.01)
    assert server.started
    return task
