"""Ops requests in flight on one socket: bounded, per peer and in all, and cancelled together.

Each request runs in its own task, so a verb that waits for the workers'
acknowledgement (``cache purge`` while a worker is frozen) never holds up
``status``, ``stop``, ``drain`` or ``reload`` behind it.  What stays bounded
is how many run at once: past ``per_peer`` for one peer, or ``total`` on the
socket, a request is answered "busy" at once instead of queued (a queue is
what let three ``stop``s run 30 s after their clients had given up).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from typing import Any, Coroutine, Hashable

__all__ = ["InFlight", "stale_by"]

#: Requests one peer may have running at once; requests all peers may have running on one socket.
PER_PEER = 8
TOTAL = 64


def stale_by(timeout: Any, sent_at: Any, now_wall: float) -> float | None:
    """Seconds past the client's own deadline (``sent_at + timeout``), or None while someone still waits.

    Wall clocks: only meaningful where client and supervisor share the
    clock (local sockets); a client that says nothing (0) never expires.
    """
    if not isinstance(timeout, (int, float)) or not isinstance(sent_at, (int, float)):
        return None
    if not (math.isfinite(timeout) and math.isfinite(sent_at)) or timeout <= 0 or sent_at <= 0:
        return None
    late = now_wall - (sent_at + timeout)
    return late if late > 0 else None


class InFlight:
    """The running request tasks of one ops socket, counted per peer key."""

    def __init__(self, *, per_peer: int = PER_PEER, total: int = TOTAL) -> None:
        self.per_peer = per_peer
        self.total = total
        self.busy_refused = 0
        self._tasks: dict[asyncio.Task[Any], Hashable] = {}
        self._per: Counter[Hashable] = Counter()

    def refusal(self, key: Hashable) -> str | None:
        """Why a new request from ``key`` cannot start now (None: it can)."""
        if self._per[key] >= self.per_peer:
            self.busy_refused += 1
            return (f"busy: {self._per[key]} requests from this client are still running (at most {self.per_peer}); "
                    "retry when one has answered")
        if len(self._tasks) >= self.total:
            self.busy_refused += 1
            return f"busy: {len(self._tasks)} ops requests are running (at most {self.total}); retry shortly"
        return None

    def start(self, key: Hashable, coro: Coroutine[Any, Any, Any], name: str = "ops-request") -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks[task] = key
        self._per[key] += 1
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        key = self._tasks.pop(task, None)
        if key is not None:
            self._per[key] -= 1
            if self._per[key] <= 0:
                del self._per[key]

    def __len__(self) -> int:
        return len(self._tasks)

    async def cancel_all(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def wall() -> float:
    """The wall clock the client's ``sent_at`` is on (a function: tests replace it)."""
    return time.time()
