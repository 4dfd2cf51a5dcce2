"""The worker notices its own fd exhaustion (asyncio reports it; uvloop/libuv hides it)."""

from __future__ import annotations

import errno
from typing import Any

from numaserve.worker.fdwatch import RECENT_S, FdWatch


class Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def error(self, event: str, **kw: Any) -> None:
        self.events.append((event, kw))


class Loop:
    def __init__(self) -> None:
        self.default: list[dict[str, Any]] = []

    def default_exception_handler(self, context: dict[str, Any]) -> None:
        self.default.append(context)


def test_asyncio_accept_errors_are_counted_and_logged_once_a_minute() -> None:
    now = [0.0]
    log = Log()
    w = FdWatch(log, clock=lambda: now[0], count_fds=lambda: 10, soft_limit=lambda: 1024)
    loop = Loop()
    for _ in range(5):
        w.exception_handler(loop, {"message": "socket.accept() out of system resource",
                                   "exception": OSError(errno.EMFILE, "Too many open files")})
    assert w.accept_errors == 5 and w.limited and loop.default == []
    assert [e for e, _ in log.events] == ["accept_failed"] and log.events[0][1]["error"] == "EMFILE"
    assert "LimitNOFILE" in log.events[0][1]["fix"]
    w.exception_handler(loop, {"message": "something else", "exception": ValueError("x")})
    assert len(loop.default) == 1              # not ours: the default handler
    now[0] = RECENT_S + 1
    assert not w.limited and w.extra()["fd_limited"] is False and w.extra()["accept_errors"] == 5


def test_sampling_catches_the_silent_uvloop_case_cheaply() -> None:
    now = [0.0]
    fds = [20]
    counted = []

    def count() -> int | None:
        counted.append(1)
        return fds[0]

    log = Log()
    w = FdWatch(log, clock=lambda: now[0], count_fds=count, soft_limit=lambda: 64)
    counted.clear()
    w.sample(connections=2)          # first sample: a full count (sets the baseline)
    assert len(counted) == 1 and not w.limited
    now[0] = 1.0
    w.sample(connections=3)          # far from the limit: estimated, not listed
    assert len(counted) == 1 and w.fds_open == 21
    fds[0] = 62
    now[0] = 2.0
    w.sample(connections=44)         # the estimate passes half the limit: counted, at the limit
    assert len(counted) == 2 and w.limited and w.limit_hits == 1
    assert w.extra() == {"accept_errors": 0, "fd_limit_hits": 1, "fds_open": 62, "fd_limit": 64, "fd_limited": True}
    fds[0] = None  # type: ignore[assignment]    # cannot even list /proc/self/fd: EMFILE
    now[0] = 3.0
    w.sample(connections=44)
    assert w.fds_open == 64 and w.limit_hits == 2
    assert [e for e, _ in log.events] == ["accept_failed"]   # logged once per minute
