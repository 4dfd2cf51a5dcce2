"""Test app for long loads (issue 31): the preload hook ``loadapp:load`` loads for LOADAPP_S seconds.

LOADAPP_MODE:
  ``report``  sleeps in small steps and calls numaserve.report_progress (the GIL released)
  ``sleep``   one plain time.sleep, no report: only the load beat thread says it is alive
  ``gil``     holds the GIL in single C calls longer than LOADAPP_CALL_S each (str -> int
              conversion of a huge number): no thread in the process runs meanwhile, only its
              CPU time moves
LOADAPP_LIFESPAN_RAISE: the lifespan raises RuntimeError(that text) after lifespan.startup.
The app answers its pid and the mode.
"""

import os
import sys
import time

import numaserve
from asgi_helpers import lifespan, reply

MODE = os.environ.get("LOADAPP_MODE", "report")


def _hold_gil(seconds: float, call_s: float) -> None:
    """Hold the GIL for ``seconds`` in C calls of at least ``call_s`` each."""
    sys.set_int_max_str_digits(0)
    n = 100_000
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        int("9" * n)               # quadratic in C, the GIL held throughout
        if time.monotonic() - t0 < call_s:
            n = int(n * 1.5)


def load() -> None:
    seconds = float(os.environ.get("LOADAPP_S", "6"))
    if MODE == "sleep":
        time.sleep(seconds)
    elif MODE == "gil":
        _hold_gil(seconds, float(os.environ.get("LOADAPP_CALL_S", "3")))
    else:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            numaserve.report_progress(1 - left / seconds, f"shard {int((1 - left / seconds) * 8) + 1}/8")
            time.sleep(min(0.2, left))
        numaserve.report_progress(1.0, "done")


async def app(scope, receive, send):
    if scope["type"] == "lifespan" and os.environ.get("LOADAPP_LIFESPAN_RAISE"):
        await receive()
        raise RuntimeError(os.environ["LOADAPP_LIFESPAN_RAISE"])
    if await lifespan(scope, receive, send):
        return
    await reply(send, {"pid": os.getpid(), "mode": MODE})
