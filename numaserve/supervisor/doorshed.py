"""The supervisor answers 503 from a stalled or overloaded worker's accept queue (issue 13).

Why here and not only in the worker: the worker's sentinel thread needs the
worker's GIL, and each of its wake-ups waits ~a switch interval behind the
busy loop (503 p50 22-30 ms); the supervisor owns the very same listening
socket (the worker's fd is a duplicate), has its own GIL and is idle, so a
connection it answers waits for nothing.  The worker's sentinel stays as
the fallback (a supervisor without this thread, a slot in motion, a C call
holding the worker's GIL for long): both leave what the gate would admit,
so together they answer no more than either alone.

A ``DoorShedder`` thread, started once, reads the shared page of every
*settled* slot (READY, nothing in motion: not starting, reloading, draining,
retiring, being forked) every ``IDLE_CHECK_S`` — a few struct reads, no
listener is watched.  Only while a page says its gate is overloaded or
shedding (``numaserve.loops.door.armed``) does it ``poll()`` that slot's
listeners, and for each connection waiting it asks ``door.excess`` how
many of the oldest to answer (503 + Retry-After + Connection: close, the
head read first and the rest of the request drained for ``LINGER_S`` so the
close sends no RST).  A connection whose first byte is not an HTTP method
(the length-prefixed frames share the port) is handed back to the worker
untouched over its hand-back socket (``numaserve.worker.handback``); if
that fails it is closed.  TLS listeners are never armed.
"""

from __future__ import annotations

import os
import random
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from numaserve.loops import door
from numaserve.loops.admission import AdmissionSettings
from numaserve.net import heldsock
from numaserve.net.gatepage import GatePage, GateView, create_page
from numaserve.net.listeners import accept_queue_depth
from numaserve.worker.handback import handback_path, send_fd
from numaserve.worker.shedding import overload_response

__all__ = ["DoorShedder", "DoorTarget", "QueueShed", "loop_cpu", "page_path"]

#: Seconds between two looks at the pages while nobody is overloaded.
IDLE_CHECK_S = 0.05
#: While armed: look again this soon when connections were left for the loop.
KEEP_POLL_S = 0.001
#: ... doubling up to this while those connections needed nothing from us (each look costs ~0.1 ms).
KEEP_POLL_MAX_S = 0.008
#: A connection whose first byte has not arrived after this long goes back to its worker, unanswered.
HEAD_WAIT_S = 0.05
LINGER_S = 1.0
LINGER_READS = 4
#: Answered connections are drained (and closed once their client closed) this often.
LINGER_CHECK_S = 0.01


def page_path(runtime_dir: str, slot: int) -> str:
    return os.path.join(runtime_dir, f"gate-{slot}.page")


def loop_cpu(pid: int, tid: int) -> float | None:
    """The CPU time of a thread (s; ``sum_exec_runtime``, the clock of CLOCK_THREAD_CPUTIME_ID)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class DoorTarget:
    """A settled slot the shedder may act for: its worker's pid and its listeners."""

    slot: int
    pid: int
    listeners: tuple[socket.socket, ...]
    page: GatePage
    still_settled: Callable[[], bool]   # re-checked just before acting (the loop may be mid-reload)


class DoorShedder(threading.Thread):
    def __init__(self, settings: AdmissionSettings) -> None:
        super().__init__(name="numaserve-doorshed", daemon=True)
        self.s = settings
        self.targets: dict[int, DoorTarget] = {}   # replaced whole by the supervision loop
        self._stop_evt = threading.Event()
        self._pending: list[tuple[int, float, int]] = []   # (fd, deadline, slot): head not read yet
        self._linger: list[tuple[int, float]] = []
        self._linger_at = 0.0
        self.passes = 0
        self._rng = random.Random()
        self.shed: dict[int, int] = {}
        self.handed_back = 0
        self.armings = 0

    def set_targets(self, targets: dict[int, DoorTarget]) -> None:
        self.targets = targets

    def stop(self, timeout: float = 1.0) -> None:
        self._stop_evt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    def status(self) -> dict[str, object]:
        try:
            cpu = round(time.clock_gettime(time.pthread_getcpuclockid(self.ident or 0)), 3)
        except (OSError, AttributeError, OverflowError):
            cpu = None
        return {"shed": dict(self.shed), "handed_back": self.handed_back, "armings": self.armings,
                "passes": self.passes, "cpu_s": cpu}

    def run(self) -> None:
        try:
            self._run()
        finally:
            for fd, *_ in self._pending + self._linger:
                heldsock.close(fd)

    def _views(self, now: float) -> list[tuple[DoorTarget, GateView]]:
        out = []
        for t in list(self.targets.values()):
            v = t.page.read()
            if v is not None and v.pid == t.pid and door.armed(v, now, self.s):
                out.append((t, v))
        return out

    def _run(self) -> None:
        was_armed = False
        backoff = KEEP_POLL_S
        while not self._stop_evt.is_set():
            now = time.monotonic()
            live = self._views(now)
            if not live:
                was_armed = False
                self._service(now)
                self._stop_evt.wait(KEEP_POLL_S * 10 if (self._pending or self._linger) else IDLE_CHECK_S)
                continue
            if not was_armed:
                self.armings += 1
                was_armed = True
            poller = select.poll()
            for t, _ in live:
                for lst in t.listeners:
                    poller.register(lst.fileno(), select.POLLIN)
            wait_ms = KEEP_POLL_S * 10 * 1000 if (self._pending or self._linger) else IDLE_CHECK_S * 1000
            if not poller.poll(wait_ms):
                self._service(time.monotonic())
                continue
            kept = answered = 0
            self.passes += 1
            for t, _ in live:
                now = time.monotonic()
                v = t.page.read()    # the freshest stamp
                if v is None or v.pid != t.pid or not t.still_settled():
                    continue
                # the thread's CPU only matters for a stall (and costs a /proc read)
                cpu = loop_cpu(v.pid, v.tid) if door.stalled_for(v, now) >= v.stall_limit else None
                for lst in t.listeners:
                    depth = accept_queue_depth(lst) or 0
                    n = door.excess(v, now, cpu, depth, self.s)
                    kept += depth - n
                    for _ in range(n):
                        if not self._take(t, lst, now):
                            break
                        answered += 1
            self._service(time.monotonic())
            if kept > 0:   # connections left for the loop: the listener stays readable, so poll() would
                # not wait; look again soon after answering, later and later while nothing needed it
                backoff = KEEP_POLL_S if answered else min(backoff * 2, KEEP_POLL_MAX_S)
                self._stop_evt.wait(backoff)
            else:
                backoff = KEEP_POLL_S

    def _take(self, t: DoorTarget, lst: socket.socket, now: float) -> bool:
        fd = heldsock.accept(lst.fileno())
        if fd < 0:
            return False
        self._answer_or_wait(fd, now + HEAD_WAIT_S, t.slot)
        return True

    def _answer_or_wait(self, fd: int, deadline: float, slot: int) -> None:
        n, first = heldsock.recv(fd, peek=True)
        if n == -heldsock.EAGAIN:
            if time.monotonic() < deadline:
                self._pending.append((fd, deadline, slot))
                return
            # nothing sent yet: it may be a frame client, which an HTTP 503 would break; the worker
            # reads whatever it turns out to be (as it would have without the door)
            self._hand_back(fd, slot)
            return
        elif n <= 0:       # the client left (or an error): nothing to answer
            heldsock.close(fd)
            return
        if not (65 <= first[0] <= 90):   # not an HTTP method (frames): the worker's own
            self._hand_back(fd, slot)
            return
        heldsock.recv(fd)   # the head: read, so closing sends no RST
        retry = self._rng.choice((1, 2))
        if heldsock.send(fd, overload_response(retry, "overloaded")) < 0 or heldsock.shutdown_wr(fd) < 0:
            heldsock.close(fd)
            return
        self.shed[slot] = self.shed.get(slot, 0) + 1
        self._linger.append((fd, time.monotonic() + LINGER_S))

    def _hand_back(self, fd: int, slot: int) -> None:
        t = self.targets.get(slot)
        try:
            if t is None:
                raise OSError("slot gone")
            send_fd(handback_path(t.page.path), fd)
            self.handed_back += 1
        except OSError:
            pass
        heldsock.close(fd)   # (sent: the worker holds its own duplicate)

    def _service(self, now: float) -> None:
        if self._pending:
            pending, self._pending = self._pending, []
            for fd, deadline, slot in pending:
                self._answer_or_wait(fd, deadline, slot)
        if self._linger and now >= self._linger_at:
            self._linger_at = now + LINGER_CHECK_S   # draining them is not urgent: a syscall each
            keep = []
            for fd, deadline in self._linger:
                done = now >= deadline
                for _ in range(LINGER_READS):
                    if done:
                        break
                    n, _ = heldsock.recv(fd)
                    if n == -heldsock.EAGAIN:
                        break
                    done = n <= 0
                if done:
                    heldsock.close(fd)
                else:
                    keep.append((fd, deadline))
            self._linger = keep


class QueueShed:
    """The arbiter's handle: pages per slot, the thread, its targets (``tick``)."""

    def __init__(self, runtime_dir: str, settings: AdmissionSettings, enabled: bool) -> None:
        self.runtime_dir = runtime_dir
        self.settings = settings
        self.enabled = enabled and heldsock.AVAILABLE
        self._pages: dict[int, GatePage] = {}
        self.thread: DoorShedder | None = None

    def page_for(self, slot: int) -> str:
        """The slot's page path for its worker's spec ("" when off or the file cannot be made)."""
        if not self.enabled:
            return ""
        if slot not in self._pages:
            path = page_path(self.runtime_dir, slot)
            try:
                create_page(path)
                self._pages[slot] = GatePage(path)
            except OSError:
                return ""
        return self._pages[slot].path

    def tick(self, slots: dict[int, object], listeners: dict[int, list[socket.socket]],
             settings: AdmissionSettings | None = None) -> None:
        """Act for the settled slots only (every other state: the thread leaves the slot alone)."""
        if not self.enabled:
            return
        if settings is not None:
            self.settings = settings
            if self.thread is not None:
                self.thread.s = settings
        targets: dict[int, DoorTarget] = {}
        for n, slot in slots.items():
            w = getattr(slot, "worker", None)
            page = self._pages.get(n)
            if page is None or w is None or not slot.settled() or not listeners.get(n):   # type: ignore[attr-defined]
                continue
            targets[n] = DoorTarget(n, w.pid, tuple(listeners[n]), page, slot.settled)   # type: ignore[attr-defined]
        if targets and self.thread is None:
            self.thread = DoorShedder(self.settings)
            self.thread.start()
        if self.thread is not None:
            old = self.thread.targets
            if {k: (t.pid, t.listeners) for k, t in old.items()} != {k: (t.pid, t.listeners) for k, t in targets.items()}:
                self.thread.set_targets(targets)

    def status(self) -> dict[str, object] | None:
        if not self.enabled:
            return None
        t = self.thread
        return {"targets": sorted(t.targets) if t else [], **(t.status() if t else {"shed": {}})}

    def close(self) -> None:
        if self.thread is not None:
            self.thread.stop()
            self.thread = None
        for p in self._pages.values():
            try:
                p.close()
            except (BufferError, ValueError):
                pass
            for path in (p.path, handback_path(p.path)):
                try:
                    os.unlink(path)
                except OSError:
                    pass
        self._pages.clear()
