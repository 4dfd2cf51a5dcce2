"""Give back the supervisor's start-up garbage once every slot serves.

Why: start-up parses the config, discovers the topology, imports the control
plane and spawns every worker; much of what that allocated is garbage by the
time the service runs (cyclic garbage the GC has not reached, free pages
glibc keeps in its heaps).  The supervisor is one more process on every
node's memory beside the workers (issue 17 compares the whole tree's PSS with
gunicorn --preload's), so once the supervisor first reaches ``running`` (or
``degraded``) it runs one full collection and ``malloc_trim(0)``, which
returns the free heap pages to the kernel.  Once only: later garbage is the
GC's ordinary business.
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any, Callable

import structlog

from numaserve.memtrim import malloc_trim

__all__ = ["SETTLED_STATES", "trim_once_settled"]

log = structlog.get_logger("numaserve.supervisor")

SETTLED_STATES = ("running", "degraded")



def _private_kb(path: str = "/proc/self/smaps_rollup") -> int | None:
    try:
        with open(path) as f:
            fields = dict(line.split()[:2] for line in f if line.startswith("Private_"))
        return sum(int(v) for v in fields.values())
    except (OSError, ValueError):
        return None


async def trim_once_settled(state: Callable[[], Any], *, poll_s: float = 0.25, limit_s: float = 600.0,
                            trim: Callable[[], bool | None] = malloc_trim) -> bool:
    """Wait until ``state()`` is settled (bounded by ``limit_s``), then collect and trim once.

    Returns whether it trimmed (False: never settled within the limit, or cancelled first).
    """
    deadline = time.monotonic() + limit_s
    while state() not in SETTLED_STATES:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(poll_s)
    before = _private_kb()
    collected = gc.collect()
    released = trim()
    after = _private_kb()
    log.debug("startup_memory_trimmed", collected=collected, released=released,
              private_kb_before=before, private_kb_after=after)
    return True
