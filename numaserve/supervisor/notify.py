"""systemd notification protocol (sd_notify(3)) without libsystemd.

One AF_UNIX datagram of newline-separated KEY=VALUE lines to
``$NOTIFY_SOCKET`` (a leading "@" is the abstract namespace).  Silent no-op
when not run by systemd.  The watchdog interval comes from
``$WATCHDOG_USEC`` (honoured only when ``$WATCHDOG_PID`` is unset or ours).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Iterable, Mapping

from numaserve.supervisor.slots import FAILED, LOADING, READY, SlotState


# systemd's STATUS_TEXT_MAX is 4 KiB; keep status lines well inside one datagram.
STATUS_MAX = 1000

#: While loads are alive before READY=1, systemd's start timeout is pushed this far
#: ahead (EXTEND_TIMEOUT_USEC), at most once per EXTEND_EVERY_S, from EXTEND_AFTER_S
#: after start on (inside systemd's default 90 s; a short start needs no message).
EXTEND_BY_S = 60.0
EXTEND_EVERY_S = 10.0
EXTEND_AFTER_S = 45.0


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        addr = env.get("NOTIFY_SOCKET", "")
        self.address: str | None = None
        if addr:
            self.address = "\0" + addr[1:] if addr.startswith("@") else addr
        self.watchdog_interval: float | None = None
        usec = env.get("WATCHDOG_USEC", "")
        wpid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not wpid or wpid == str(os.getpid())):
            self.watchdog_interval = int(usec) / 1e6
        self.last_ping: float | None = None
        self.last_extend: float | None = None
        self.created = time.monotonic()
        self.ready_sent = False
        self.last_line = ""                       # the STATUS= last sent (a new one only when it changes)
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *, wait: bool = True, **fields: object) -> bool:
        """Send KEY=VALUE lines; keys are given in Python form (READY=1 → READY=1).

        ``wait=False``: dropped rather than waited for when the receiver's queue is full
        (advice such as STATUS= must never stall the supervision loop)."""
        if self.address is None:
            return False
        payload = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, 0 if wait else socket.MSG_DONTWAIT, self.address)
            return True
        except OSError:
            return False

    def ready(self, status: str) -> None:
        if not self.ready_sent:
            self.ready_sent = True
            self.send(READY=1, STATUS=status, MAINPID=os.getpid())
            self.ping(time.monotonic())  # first ping right after READY (no kill window)

    def status(self, status: str) -> None:
        self.send(STATUS=status, wait=False)

    def extend_start(self, now: float) -> bool:
        """A load is alive before READY=1: push systemd's TimeoutStartSec out (systemd >= 236).

        The loads themselves are judged by the supervisor (a stalled one is killed), so a
        long model load is not cut by the unit's start timeout.  True when sent."""
        if self.ready_sent or self.address is None or now - self.created < EXTEND_AFTER_S:
            return False
        if self.last_extend is not None and now - self.last_extend < EXTEND_EVERY_S:
            return False
        self.last_extend = now
        return self.send(EXTEND_TIMEOUT_USEC=int(EXTEND_BY_S * 1e6), wait=False)

    def stopping(self, status: str = "stopping") -> None:
        self.send(STOPPING=1, STATUS=status)

    def reloading(self, status: str = "reloading") -> None:
        """RELOADING=1 with MONOTONIC_USEC (CLOCK_MONOTONIC, µs): systemd >= 253 ignores
        a RELOADING=1 without it, or older than the reload it asked for.  Nothing
        before the first READY=1: systemd is still waiting for start-up to end."""
        if not self.ready_sent:
            return
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.send(RELOADING=1, MONOTONIC_USEC=usec, STATUS=status)

    def reload_done(self, status: str) -> None:
        """READY=1 after RELOADING=1: the reload finished, failed or was refused (``status`` says which)."""
        if not self.ready_sent:
            return  # a READY=1 now would end systemd's start-up before every slot is ready
        self.send(READY=1, STATUS=status[:STATUS_MAX])

    def ping_due(self, now: float) -> bool:
        if self.watchdog_interval is None or not self.ready_sent:
            return False
        return self.last_ping is None or now - self.last_ping >= self.watchdog_interval / 2

    def ping(self, now: float) -> None:
        if self.watchdog_interval is not None:
            self.send(WATCHDOG=1)
            self.last_ping = now

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def status_line(state: str, slots: Iterable[SlotState]) -> str:
    """One-line per-node summary for systemd's STATUS= (and logs)."""
    slots = list(slots)
    nodes: dict[int, list[str]] = {}
    for s in slots:
        nodes.setdefault(s.plan.node, []).append(s.shown_state())
    parts = []
    for node, states in sorted(nodes.items()):
        ready = states.count(READY)
        extra = sorted({st for st in states if st != READY})
        parts.append(f"node{node} {ready}/{len(states)} ready" + (f" ({','.join(extra)})" if extra else ""))
    line = f"{state}: " + "; ".join(parts)
    now = time.monotonic()
    loading = [f"slot {s.plan.slot} {s.worker.load.describe(now)}" for s in slots
               if s.shown_state() == LOADING and s.worker is not None and s.worker.load is not None]
    if loading:  # how far each load has come (elapsed, and the app's progress when it reports it)
        line += "; " + "; ".join(loading[:8])
    failed = [s for s in slots if s.state == FAILED]
    if failed:  # say what is missing and why (systemctl status shows this line)
        line += "; missing: " + "; ".join(
            f"slot {s.plan.slot} failed ({(s.failed_reason or '?')[:120]})" for s in failed)
    return line[:500]
