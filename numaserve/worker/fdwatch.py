"""A worker at its open-file limit: noticed, counted, logged, reported in Stats.

Neither event loop says anything when ``accept()`` fails for lack of fds:

* asyncio (``selector_events._accept_connection``) calls the loop's
  exception handler with "socket.accept() out of system resource" and
  stops accepting on that listener for a second -- the default handler
  logs it, but through the ``asyncio`` logger, as noise;
* uvloop leaves it to libuv, whose "EMFILE trick" (``uv__emfile_trick``)
  closes a reserved fd, accepts every queued connection and closes it at
  once, and reopens the reserve: clients see a reset or an empty reply and
  the application hears nothing.

So the worker (1) counts the asyncio reports through its exception handler,
and (2) samples its fd count against ``RLIMIT_NOFILE`` once per stats
interval (cheaply: a full ``/proc/self/fd`` listing only when the
connection count says it may be close), which catches the uvloop case.
Either marks the worker ``fd_limited`` for ``RECENT_S`` seconds; the
supervisor shows the slot as "degraded (fd limit)".
"""

from __future__ import annotations

import errno
import os
import resource
import time
from typing import Any, Callable

__all__ = ["FdWatch", "RECENT_S"]

RECENT_S = 10.0
FULL_EVERY_S = 30.0
HEADROOM = 4          # fewer free fds than this is as good as none for a server
_LOG_EVERY = 60.0
_ACCEPT_MESSAGE = "socket.accept() out of system resource"


def _count_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd")) - 1
    except OSError:
        return None  # EMFILE: could not even open the directory


def _soft_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 30 if soft == resource.RLIM_INFINITY else int(soft)


class FdWatch:
    def __init__(self, log: Any, *, clock: Callable[[], float] = time.monotonic,
                 count_fds: Callable[[], int | None] = _count_fds,
                 soft_limit: Callable[[], int] = _soft_limit) -> None:
        self.log = log
        self.clock = clock
        self.count_fds = count_fds
        self.soft_limit = soft_limit
        self.accept_errors = 0      # exact, from asyncio's reports
        self.limit_hits = 0         # samples taken at the limit (uvloop's silent case)
        self.fds_open: int | None = None
        self.fd_limit = soft_limit()
        self.baseline = count_fds() or 0
        self._last_hit: float | None = None
        self._last_full = -1e9
        self._last_log = -1e9
        self._logged_count = 0

    # -- asyncio's report -----------------------------------------------------
    def exception_handler(self, loop: Any, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
            self.accept_errors += 1
            self._hit(exc.errno, str(context.get("message") or _ACCEPT_MESSAGE))
            return
        loop.default_exception_handler(context)

    # -- sampling -------------------------------------------------------------
    def sample(self, connections: int) -> None:
        """Once per stats interval; ``connections`` is the server's open connection count.

        A full count of ``/proc/self/fd`` when the estimate (fds besides
        connections, from the last full count, plus connections) is past
        half the limit, after a hit, or every ``FULL_EVERY_S``; otherwise the
        estimate, so a worker with 50 000 connections does not list them all
        every second.
        """
        now = self.clock()
        self.fd_limit = self.soft_limit()
        estimate = self.baseline + connections
        if estimate < self.fd_limit * 0.5 and self._last_hit is None and now - self._last_full < FULL_EVERY_S:
            self.fds_open = estimate
            return
        self._last_full = now
        n = self.count_fds()
        self.fds_open = self.fd_limit if n is None else n
        if n is not None:
            self.baseline = max(0, n - connections)
        if self.fds_open >= self.fd_limit - HEADROOM:
            self.limit_hits += 1
            self._hit(errno.EMFILE, "open files at the limit: new connections are reset")

    def _hit(self, code: int, what: str) -> None:
        now = self.clock()
        self._last_hit = now
        if now - self._last_log >= _LOG_EVERY:
            self._last_log = now
            self.log.error(
                "accept_failed", error=errno.errorcode.get(code, str(code)), detail=what,
                accept_errors=self.accept_errors, limit_hits=self.limit_hits, fds_open=self.fds_open,
                fd_limit=self.fd_limit,
                fix="raise LimitNOFILE= (systemd) / ulimit -n, or cap connections with server.max_connections",
            )

    @property
    def limited(self) -> bool:
        return self._last_hit is not None and self.clock() - self._last_hit < RECENT_S

    def extra(self) -> dict[str, Any]:
        """Keys for ``Stats.extra``."""
        if self._last_hit is not None and not self.limited:
            self._last_hit = None
        return {"accept_errors": self.accept_errors, "fd_limit_hits": self.limit_hits,
                "fds_open": self.fds_open or 0, "fd_limit": self.fd_limit, "fd_limited": self.limited}
