"""Is a template or worker that is not ready yet still loading, or stuck?

A model load takes minutes and may hold the GIL for long stretches
(``np.fromfile``, unpickling, ``torch.load``), so a heartbeat from inside the
process cannot be the only sign of life.  While a process loads, any of
these counts as progress:

* a beat: the control-channel heartbeat, or the load beat thread's stamp in
  the progress file (``numaserve.progress``);
* an app's ``report_progress`` call;
* a counter read from outside moving: CPU time (``/proc/PID/stat`` utime +
  stime), bytes read (``/proc/PID/io`` rchar + read_bytes), page faults
  (minflt + majflt), or resident memory above its peak so far.

A process with none of these for ``supervisor.heartbeat_timeout`` is stalled:
frozen (SIGSTOP), deadlocked with the GIL held, or stuck in the kernel (state
D with no I/O moving).  A wall-clock bound on loading exists only when the
operator sets ``supervisor.ready_timeout``.

Pure apart from ``read_sample``: the caller passes the clock and the readings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["LoadProgress", "ProcSample", "load_verdict", "parse_stat", "read_sample", "ready_timeout_message"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class ProcSample:
    """The counters of one process that move while it does anything at all."""

    state: str              # R, S, D, T (stopped), t (traced), Z
    cpu_ticks: int          # utime + stime
    faults: int             # minflt + majflt
    rss_bytes: int
    io_bytes: int | None    # rchar + read_bytes; None when /proc/PID/io is not readable


def parse_stat(text: str) -> tuple[str, int, int, int]:
    """(state, utime+stime, minflt+majflt, rss pages) from a ``/proc/PID/stat`` line (ValueError if malformed)."""
    try:
        f = text.rsplit(")", 1)[1].split()
        # fields after the command: state(3) ppid ... minflt(10) cminflt majflt(12) cmajflt utime(14) stime(15)
        return f[0], int(f[11]) + int(f[12]), int(f[7]) + int(f[9]), int(f[21])
    except (IndexError, ValueError) as e:
        raise ValueError(f"malformed /proc stat line: {e}") from None


def _io_bytes(text: str) -> int | None:
    total, seen = 0, False
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("rchar", "read_bytes"):
            try:
                total += int(value)
                seen = True
            except ValueError:
                return None
    return total if seen else None


def read_sample(pid: int, proc: str = "/proc") -> ProcSample | None:
    """A process's counters now; None when it is gone (or its stat is unreadable)."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            state, cpu, faults, rss_pages = parse_stat(f.read())
    except (OSError, ValueError):
        return None
    try:
        with open(f"{proc}/{pid}/io") as f:
            io = _io_bytes(f.read())
    except OSError:
        io = None
    return ProcSample(state=state, cpu_ticks=cpu, faults=faults, rss_bytes=rss_pages * _PAGE, io_bytes=io)



def _children(pid: int, proc: str) -> dict[int, list[int]]:
    """ppid -> pids, from every /proc/PID/stat (read once per sample)."""
    kids: dict[int, list[int]] = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return kids
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(name))
    return kids


def read_tree_sample(pid: int, proc: str = "/proc") -> ProcSample | None:
    """The counters of ``pid`` and all its descendants, added up (the state is ``pid``'s own).

    Why: a ``--cmd`` server often loads in a child (gunicorn's workers, an engine process) while
    the process numaserve started waits; judged alone it would look stalled.
    """
    root = read_sample(pid, proc)
    if root is None:
        return None
    kids = _children(pid, proc)
    cpu, faults, rss, io = root.cpu_ticks, root.faults, root.rss_bytes, root.io_bytes
    todo, seen = list(kids.get(pid, ())), {pid}
    while todo:
        child = todo.pop()
        if child in seen:
            continue
        seen.add(child)
        todo.extend(kids.get(child, ()))
        s = read_sample(child, proc)
        if s is None:
            continue
        cpu, faults, rss = cpu + s.cpu_ticks, faults + s.faults, rss + s.rss_bytes
        if io is not None and s.io_bytes is not None:
            io += s.io_bytes
    return ProcSample(state=root.state, cpu_ticks=cpu, faults=faults, rss_bytes=rss, io_bytes=io)

@dataclass
class LoadProgress:
    """Signs of life of one loading process (a template or a worker), and what it reported."""

    started: float
    last_sign: float
    sign: str = "started"              # what moved last
    sample: ProcSample | None = None
    peak_rss: int = 0
    fraction: float | None = None
    note: str = ""
    beat: float | None = None          # the last beat seen (channel heartbeat or progress file)
    reported: float | None = None      # the last report_progress seen
    logged: float | None = None        # the last "loading" log line

    @classmethod
    def begin(cls, now: float) -> LoadProgress:
        return cls(started=now, last_sign=now)

    def _moved(self, now: float, what: str) -> None:
        if now >= self.last_sign:
            self.last_sign, self.sign = now, what

    def observe(self, now: float, sample: ProcSample | None) -> None:
        """Compare a /proc reading with the previous one; any counter moving is progress."""
        if sample is None:
            return
        old = self.sample
        self.sample = sample
        if old is not None:
            if sample.cpu_ticks != old.cpu_ticks:
                self._moved(now, "cpu")
            elif sample.io_bytes is not None and old.io_bytes is not None and sample.io_bytes != old.io_bytes:
                self._moved(now, "io")
            elif sample.faults != old.faults:
                self._moved(now, "page faults")
            elif sample.rss_bytes > self.peak_rss:
                self._moved(now, "memory")
        self.peak_rss = max(self.peak_rss, sample.rss_bytes)

    def heard(self, now: float, beat: float | None, what: str = "heartbeat") -> None:
        """A beat stamped at ``beat`` (monotonic; None: none yet); newer than the last one is progress."""
        if beat is not None and (self.beat is None or beat > self.beat):
            self.beat = beat
            self._moved(min(now, beat), what)

    def report(self, now: float, at: float | None, fraction: float | None, note: str) -> None:
        """An app's ``report_progress``, stamped at ``at``; a new one is progress."""
        if at is not None and (self.reported is None or at > self.reported):
            self.reported = at
            self.fraction, self.note = fraction, note
            self._moved(min(now, at), "progress report")

    @property
    def frozen(self) -> bool:
        """Stopped by a signal (SIGSTOP/SIGTSTP) or a tracer at the last reading."""
        return self.sample is not None and self.sample.state in ("T", "t")

    def log_due(self, now: float, every: float) -> bool:
        if now - (self.logged if self.logged is not None else self.started) >= every:
            self.logged = now
            return True
        return False

    def to_json(self, now: float) -> dict[str, Any]:
        """What ``status`` shows for a loading slot or template."""
        return {
            "elapsed_s": round(now - self.started, 1),
            "fraction": None if self.fraction is None else round(self.fraction, 4),
            "note": self.note or None,
            "rss_bytes": self.sample.rss_bytes if self.sample else None,
            "peak_rss_bytes": self.peak_rss or None,
            "last_sign": self.sign,
            "last_sign_s": round(max(0.0, now - self.last_sign), 1),
        }

    def describe(self, now: float) -> str:
        """One phrase for systemd's STATUS=: ``loading 40s 35% layer 12/32``.

        Elapsed time in 10 s steps and whole percent: the line changes (and is sent)
        a few times a minute, not on every supervision tick."""
        out = f"loading {int((now - self.started) // 10 * 10)}s"
        if self.fraction is not None:
            out += f" {int(self.fraction * 100)}%"
        if self.note:
            out += f" {self.note[:60]}"
        return out


def ready_timeout_message(deadline: float, elapsed: float) -> str:
    """The error when an operator's loading deadline passes: it names the key and the way out."""
    return (f"supervisor.ready_timeout = {deadline:g} exceeded while loading (elapsed {elapsed:.0f} s); "
            "raise it or set 0 for none")


def load_verdict(p: LoadProgress, now: float, *, stall_after: float, deadline: float = 0.0) -> str | None:
    """None while the process may go on loading; else why it must be killed.

    ``stall_after``: seconds with no sign of life (``supervisor.heartbeat_timeout``).
    ``deadline``: ``supervisor.ready_timeout`` (0: loading has no wall-clock bound).
    """
    elapsed = now - p.started
    if deadline > 0 and elapsed > deadline:
        return ready_timeout_message(deadline, elapsed)
    silent = now - p.last_sign
    if silent > stall_after:
        why = (f"stalled while loading: no heartbeat, progress report, CPU time, I/O or memory growth "
               f"for {silent:.1f}s (supervisor.heartbeat_timeout = {stall_after:g})")
        if p.frozen:
            why = f"frozen from outside (SIGSTOP): {why}"
        elif p.sample is not None and p.sample.state == "D":
            why += "; it waits in the kernel (state D) with no I/O moving"
        return why
    return None
