"""The guards that look once a second: memory leaks, worker age, memory locality, the fd budget.

Each may start a recycle operation (make before break, through ``Operations``);
none writes slot state.  Settled ticks are 1 s apart, busy ones 0.2 s: the
pace here keeps these reads (statm, numa_maps, /proc/self/fd) at about one a second.
"""

from __future__ import annotations

from typing import Callable

from numaserve.supervisor.agerecycle import AgeRecycle
from numaserve.supervisor.fdbudget import FdWatch
from numaserve.supervisor.leakwatch import LeakWatch
from numaserve.supervisor.localitywatch import LocalityWatch

__all__ = ["SecondWatches"]

PACE_S = 0.9   # once a second, give or take a tick


class SecondWatches:
    def __init__(self, leak: LeakWatch, age: AgeRecycle, locality: LocalityWatch,
                 fds: Callable[[], FdWatch | None]) -> None:
        self.leak = leak
        self.age = age            # worker.max_requests / max_lifetime
        self.locality = locality  # [placement] locality / repair
        self.fds = fds            # made when the supervisor opens
        self._last = 0.0

    def tick(self, now: float) -> None:
        if now - self._last < PACE_S:
            return
        self._last = now
        self.leak.tick(now)
        self.age.tick(now)
        self.locality.tick(now)
        fdwatch = self.fds()
        if fdwatch is not None:
            fdwatch.tick()
