"""How many queued connections the supervisor answers 503 for a worker (``numaserve.supervisor.doorshed``).

Why the supervisor: it owns every slot's listener, has its own GIL and is
scheduled within a fraction of a millisecond, where a worker's own sentinel
waits ~a switch interval for its worker's GIL behind the busy loop and the
loop's own gate answers only after the loop iterations that accept and read.

It acts only on evidence that needs nothing from the worker's loop at the
moment of acting: the worker's last stamp (``numaserve.net.gatepage``), the
listener's accept-queue length (``TCP_INFO``) and the loop thread's CPU time
(``/proc/<pid>/task/<tid>/schedstat``).  Two cases, both leaving what the
worker's own gate would admit and answering only the oldest excess:

* **stalled** — one call holds the loop (a blocking handler): the probe is
  ``stall_limit`` late (the gate's own ``stall_after_s`` / ``stall_idle_after_s``)
  **and** the loop's thread was on a CPU for at least ``RAN_SHARE`` of the
  time since its last stamp (a worker merely not scheduled — CPU contention,
  a new worker starting beside it — is not stalled).  Keeps what
  ``CpuGate.stall_excess`` keeps: at least ``stall_queue``.
* **overloaded** — the gate says sustained overload *and* it shed within
  ``overload_hold_s`` *and* the stamp is fresh: the gate refuses every
  request while ``max(cpu_concurrency, overload_wait_s / request CPU)``
  others wait for CPU, so that many minus the ones waiting at its last
  decision (``CpuGate.waiting``: less every request finished since, so it
  errs towards keeping more) stay for the loop.

Never while the worker is idle (nothing in flight) or in a burst (not yet
overloaded, nothing shed): at 1× load the supervisor does nothing.
``armed`` says whether the supervisor should watch the listener at all.
Pure: data in, data out.
"""

from __future__ import annotations

import math

from numaserve.loops.admission import AdmissionSettings
from numaserve.net.gatepage import GateView

__all__ = ["RAN_SHARE", "STAMP_FRESH_S", "armed", "excess", "stalled_for"]

#: A stall counts only if the loop's thread ran at least this share of the time since its stamp.
RAN_SHARE = 0.5
#: In the overloaded (not stalled) case the stamp must be at most this old past its period.
STAMP_FRESH_S = 0.005


def stalled_for(view: GateView, now: float) -> float:
    """How long the probe is overdue (its firing is one loop iteration: late = the loop is held)."""
    return now - view.beat - view.period


def armed(view: GateView | None, now: float, s: AdmissionSettings) -> bool:
    """Watch this worker's listener: requests in flight and its gate overloaded or shedding."""
    if view is None or view.inflight <= 0 or view.request_cpu_s <= 0:
        return False
    return view.overloaded or now - view.last_shed <= s.overload_hold_s


def excess(view: GateView | None, now: float, loop_cpu: float | None, queue: int,
           s: AdmissionSettings) -> int:
    """Connections to answer now from an accept queue of ``queue`` (0 = leave them all).

    ``loop_cpu``: the loop thread's CPU time now (same clock as ``view.thread_cpu``), None if
    unknown (then a stall is not confirmed and only the overloaded case applies).
    """
    if queue <= 0 or not armed(view, now, s):
        return 0
    assert view is not None
    cpu = view.request_cpu_s
    late = stalled_for(view, now)
    if late >= view.stall_limit:
        since = now - view.beat
        if loop_cpu is None or since <= 0 or loop_cpu - view.thread_cpu < RAN_SHARE * since:
            return 0   # late, but not because the loop ran: descheduled, not stalled
        budget = s.overload_wait_s - late
        keep = math.ceil(budget / cpu) if budget > 0 else 0
        return max(0, queue - max(s.stall_queue, keep))
    if not (view.overloaded and now - view.last_shed <= s.overload_hold_s) or late > STAMP_FRESH_S:
        return 0
    bound = max(s.cpu_concurrency, math.ceil(s.overload_wait_s / cpu))
    keep = max(0, bound - view.waiting)
    return max(0, queue - keep)
