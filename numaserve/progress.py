"""Load progress from a template or worker that is not ready yet, to the supervisor.

Why a file and not the control channel: a node's template loads the app and
the preload hook before it has any channel but its fork pipe (which only
answers requests), and an exec'd worker imports the app on the thread that
runs its ZeroMQ channel, so nothing is sent while an import holds it.  The
supervisor names one small file per loading process
(``NUMASERVE_PROGRESS_FILE``); the process replaces it atomically (write a
temporary file, rename), so a reader never sees half of it.

Two writers share the file:

* ``report_progress(fraction, note)``: the public API an app calls while it
  loads (``numaserve.report_progress``); a cheap no-op outside numaserve.
* ``LoadBeat``: a thread that stamps a beat every heartbeat interval while
  the process loads, so a load that sleeps or waits on the network (the GIL
  released) is seen alive.  A load that holds the GIL starves it; the
  supervisor then judges liveness from /proc counters instead
  (``numaserve.supervisor.loadwatch``).

The file holds one JSON object: ``pid``, ``beat`` and ``at`` (CLOCK_MONOTONIC
seconds, the same clock in every process of the machine), ``fraction``
(0..1 or null) and ``note``.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from typing import Any

__all__ = ["PROGRESS_ENV", "LoadBeat", "read_progress", "report_progress"]

#: The environment variable naming this process's progress file (set by the supervisor).
PROGRESS_ENV = "NUMASERVE_PROGRESS_FILE"

#: ``report_progress`` writes at most this often (a tight loop calling it costs a clock read).
MIN_REPORT_INTERVAL_S = 0.25

#: Notes longer than this are cut (the file is read every supervision tick).
NOTE_MAX = 200

_lock = threading.Lock()
_state: dict[str, Any] = {"pid": None, "path": None, "fraction": None, "note": "", "at": None,
                          "beat": None, "written": -math.inf}


def _path() -> str | None:
    """This process's progress file; looked up again after a fork (a forked worker has its own)."""
    pid = os.getpid()
    if _state["pid"] != pid:
        _state.update(pid=pid, path=os.environ.get(PROGRESS_ENV) or None, fraction=None, note="", at=None,
                      beat=None, written=-math.inf)
    return _state["path"]


def _write(path: str) -> None:
    """Replace the file with the current state (called with ``_lock`` held)."""
    body = json.dumps({"pid": _state["pid"], "beat": _state["beat"], "at": _state["at"],
                       "fraction": _state["fraction"], "note": _state["note"]})
    tmp = f"{path}.{_state['pid']}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(body)
        os.replace(tmp, path)
    except OSError:
        pass  # the supervisor removed its directory (stopping): progress is only advice


def report_progress(fraction: float | None, note: str = "") -> None:
    """Tell the supervisor how far this process's load has come.

    ``fraction`` is 0..1 (None: unknown, the note alone); ``note`` says what
    is being loaded (e.g. ``"layer 12/32"``).  Shown in ``numaserve status``,
    the loading log line and systemd's STATUS=; a report also counts as a sign
    of life while loading.  Rate-limited, never raises; does nothing outside a
    numaserve template or worker, or once the process serves.
    """
    with _lock:
        path = _path()
        if path is None:
            return
        if fraction is not None:
            try:
                fraction = float(fraction)
            except (TypeError, ValueError):
                fraction = None
            else:
                fraction = min(1.0, max(0.0, fraction)) if math.isfinite(fraction) else None
        note = str(note)[:NOTE_MAX]
        now = time.monotonic()
        changed = note != _state["note"]
        _state.update(fraction=fraction, note=note, at=now)
        if changed or fraction == 1.0 or now - _state["written"] >= MIN_REPORT_INTERVAL_S:
            _state["written"] = now
            _write(path)


def _beat() -> None:
    with _lock:
        path = _path()
        if path is None:
            return
        _state["beat"] = time.monotonic()
        _write(path)


class LoadBeat:
    """A daemon thread that stamps a beat in the progress file while the process loads.

    Started before the app is imported, stopped (and joined: a template must
    have no threads when it forks) once the process is ready.  Does nothing
    when the supervisor named no progress file.
    """

    def __init__(self, interval: float) -> None:
        self.interval = max(0.05, float(interval))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LoadBeat:
        if _path() is None or self._thread is not None:
            return self
        _beat()
        self._thread = threading.Thread(target=self._run, name="numaserve-load-beat", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            _beat()

    def stop(self) -> None:
        """Stop beating and wait until the thread is gone, from the kernel too.

        ``join`` returns when the thread's Python state is released, a moment
        before the kernel task exits; a template that checks ``/proc/self/task``
        in that moment (a busy CPU makes it long) would count the thread and
        refuse to fork for its whole life."""
        self._stop.set()
        if self._thread is not None:
            tid = self._thread.native_id
            self._thread.join()
            self._thread = None
            if tid is not None:
                wait_task_gone(tid)

    def __enter__(self) -> LoadBeat:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_task_gone(tid: int, timeout: float = 5.0, proc: str = "/proc") -> bool:
    """Wait until this process's kernel task ``tid`` has exited (False after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"{proc}/self/task/{tid}"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def read_progress(path: str) -> dict[str, Any] | None:
    """What a loading process last wrote (None when there is no file yet or it is unreadable)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    out: dict[str, Any] = {}
    for key in ("beat", "at", "fraction"):
        v = data.get(key)
        out[key] = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None
    note = data.get("note")
    out["note"] = note[:NOTE_MAX] if isinstance(note, str) else ""
    return out
