"""What numaserve's two uvicorn servers (the worker's and the supervisor's admin endpoint) change in
``uvicorn.Server``: exit on an event, a once-a-second main loop, and no signal handlers.

Why: uvicorn polls ``should_exit`` every 0.1 s — ten wake-ups a second per process, which with 32
idle workers on 2 CPUs was most of what their loops woke for, and a drained worker waited up to
0.1 s to go.  Signals belong to the supervisor (and, in a worker, to numaserve's own handlers).
Mixed in before ``uvicorn.Server``; this module does not import uvicorn, so the supervisor pays for
it only when its admin endpoint starts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Generator
from typing import Any

__all__ = ["QuietServerMixin"]

#: uvicorn's ``on_tick`` counter runs in tenths of a second and wraps at this.
_TICK_WRAP = 864000


class QuietServerMixin:
    """``class S(QuietServerMixin, uvicorn.Server)``: setting ``should_exit`` wakes the main loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._exit_evt = asyncio.Event()
        super().__init__(*args, **kwargs)

    @property
    def should_exit(self) -> bool:
        return self._exit_evt.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self._exit_evt.set()
        else:
            self._exit_evt.clear()

    async def main_loop(self) -> None:
        """uvicorn's loop, woken once a second (``on_tick`` does its once-a-second work, the Date
        header, when ``counter % 10 == 0``) or at once to exit."""
        counter = 0
        while not await self.on_tick(counter):  # type: ignore[attr-defined]
            counter = (counter + 10) % _TICK_WRAP
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._exit_evt.wait(), 1.0)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn >= 0.29 installs SIGINT/SIGTERM handlers here; numaserve owns them."""
        yield

    def install_signal_handlers(self) -> None:
        """Same for uvicorn < 0.29."""
