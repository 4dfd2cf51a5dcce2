"""Leak recycling: measure every worker's memory from outside, judge the slope,
and recycle leaking workers through the readiness-gated rolling path.

Per worker: RSS (``/proc/PID/statm``) every tick (~1 s) and USS/PSS
(``/proc/PID/smaps_rollup``) every ``uss_interval_s`` (10 s, ``LeakSettings``) while RSS moves
(every 6 intervals while it is flat), with the worker's
request count from its Stats, go to a ``LeakDetector`` (robust slope,
significance, persistence, no plateau).  A ``suspect`` verdict first asks the
worker to ``trim`` (gc.collect + malloc_trim) and re-measures; a confirmed
``leak`` (or the soft cap) recycles the slot make-before-break, one worker at
a time per node, spaced and budgeted, and never while the node is shedding
load (losing 1/N capacity would deepen the overload) unless a cap is hit.
The hard cap kills the worker at once.  Every verdict is logged with its
evidence and shown in status.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog

from numaserve.loops.leak import LeakDetector, LeakSettings, Verdict, detector_settings, resolve_budget

from numaserve.supervisor.operations import Operations
from numaserve.supervisor.slotcontrol import SlotControl, WorkerChannel
from numaserve.supervisor.slots import SlotState, WorkerProc

log = structlog.get_logger("numaserve.leak")

USS_RSS_MOVED = 1 << 20   # bytes of RSS change since the last USS read that make it due at the interval
USS_FLAT_FACTOR = 6       # with RSS flat, USS is read every this many intervals


_PAGE = os.sysconf("SC_PAGE_SIZE")


def read_statm_rss(pid: int) -> int | None:
    """RSS in bytes from ``/proc/PID/statm`` (None when unreadable).  Plain ``os`` calls: read for
    every worker every second, where ``open()``'s file objects and extra syscalls were most of it."""
    try:
        fd = os.open(f"/proc/{pid}/statm", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return int(os.read(fd, 256).split()[1]) * _PAGE
        finally:
            os.close(fd)
    except (OSError, ValueError, IndexError):
        return None


def read_smaps_rollup(pid: int) -> dict[str, int]:
    """Rss, Pss, Private_Clean + Private_Dirty (= USS) in bytes; {} when unreadable."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except (OSError, ValueError):
        return {}
    if "Private_Clean" in out or "Private_Dirty" in out:
        out["Uss"] = out.get("Private_Clean", 0) + out.get("Private_Dirty", 0)
    return out


def mem_total_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


@dataclass
class Watched:
    detector: LeakDetector
    generation: int
    pid: int
    last_uss: float = 0.0
    uss_rss: int = 0          # RSS when USS was last read
    uss: int | None = None
    pss: int | None = None
    verdict: Verdict | None = None
    trimming: bool = False
    recycling: bool = False
    start_rss: int = 0                 # RSS when this worker was first seen (growth is measured from it)
    deferred: Verdict | None = None    # a recycle verdict waiting for its turn: retried every tick
    deferred_why: str | None = None


def _shape(why: str | None) -> str | None:
    """A deferral reason without its numbers (the seconds in it change every tick)."""
    return None if why is None else re.sub(r"[0-9.]+", "#", why)


def recycle_deferral(s: Any, *, now: float, node: int, times: deque[float], last_worker: float, cap: bool,
                     shedding: bool, running_op: str | None, grown_bytes: int, slots_on_node: int) -> str | None:
    """Why a leak (or soft-cap) recycle must wait now, or None to recycle.  Pure: the clock is ``now``.

    One recycle at a time (a running operation), and spacing on the node,
    hold for every leak.  The hourly budget and the per-worker minimum only
    hold while the worker has grown less than ``recycle_anyway_bytes``: they
    keep false positives from churning workers, but with two leaking workers
    on a node and a budget of one an hour, the second grew to 1.1 GB on its
    way to the soft cap.  Caps skip everything but the running operation.
    """
    while times and now - times[0] > 3600:
        times.popleft()
    per_hour = s.recycle_per_hour or max(1, slots_on_node // 2)
    if running_op is not None:
        return f"operation {running_op} running"
    if cap:
        return None
    if shedding:
        return f"node {node} is shedding load: a recycle would deepen the overload"
    if times and now - times[-1] < s.recycle_spacing_s:
        return f"last recycle on node {node} {now - times[-1]:.0f}s ago (< {s.recycle_spacing_s:g}s)"
    if grown_bytes >= s.recycle_anyway_bytes > 0:
        return None
    if now - last_worker < s.recycle_worker_min_s:
        return f"recycled less than {s.recycle_worker_min_s:g}s ago"
    if len(times) >= per_hour:
        return (f"restart budget exhausted ({per_hour}/hour on node {node}): caps, or growth past "
                f"{s.recycle_anyway_bytes} bytes, only")
    return None


class LeakWatch:
    def __init__(self, ctl: SlotControl, channel: WorkerChannel, operations: Operations,
                 tuning: LeakSettings | None = None) -> None:
        self.ctl = ctl
        self.channel = channel
        self.tuning = tuning           # None: the fixed tuning (numaserve.loops.leak.DETECTOR)
        self.operations = operations   # a recycle is a tracked replace_slot operation
        self.watched: dict[int, Watched] = {}       # slot -> current worker's detector
        self.recycles: dict[int, deque[float]] = {}  # node -> recycle times (last hour)
        self.last_worker_recycle: dict[int, float] = {}
        self.last_verdicts: dict[int, dict[str, Any]] = {}
        # per slot, across generations: the verdicts that mattered (what recycled a worker)
        self.history: dict[int, deque[dict[str, Any]]] = {}
        self.budget = 0

    @property
    def settings(self) -> LeakSettings:
        """The fixed tuning with the ``[leak]`` keys of the config in force (a reload may change them)."""
        return detector_settings(self.ctl.cfg.leak, self.tuning)

    def _budget(self) -> int:
        if not self.budget:
            self.budget = resolve_budget(self.settings, mem_total_bytes(), max(1, len(self.ctl.slots)))
        return self.budget

    # ------------------------------------------------------------------ sampling

    def tick(self, now: float) -> None:
        for slot in self.ctl.slots.values():
            w = slot.worker
            if w is None or w.popen.poll() is not None:
                continue
            rss = read_statm_rss(w.pid)
            if rss is None:
                continue
            w.rss_bytes = rss
            wd = self.watched.get(slot.plan.slot)
            if wd is None or wd.generation != w.generation:
                wd = self._start(slot, w, now)
            if self._uss_due(wd, rss, now):
                roll = read_smaps_rollup(w.pid)
                wd.uss, wd.pss = roll.get("Uss"), roll.get("Pss")
                wd.last_uss, wd.uss_rss = now, rss
            if not self.settings.enabled or w.ready is None or w.stop_sent is not None:
                continue
            requests = w.stats.requests if w.stats else 0
            wd.detector.observe(now, requests, rss, wd.uss)
            if wd.deferred is not None and not (wd.trimming or wd.recycling):
                # its turn may have come (the operation before it ended): not at the next verdict, which
                # can be 30 s away -- with tight caps a deferred worker reached the hard cap meanwhile
                self._maybe_recycle(slot, w, wd, wd.deferred, now)
            if wd.trimming or wd.recycling or not wd.detector.due(now):
                continue
            self._judge(slot, w, wd, wd.detector.evaluate(now), now)

    def _uss_due(self, wd: Watched, rss: int, now: float) -> bool:
        """Every ``uss_interval_s`` while RSS moves; while it is flat, every ``USS_FLAT_FACTOR`` intervals.

        Why: ``smaps_rollup`` makes the kernel walk every page table of the
        worker (~0.6 ms each; with 32 idle workers it was the largest part of
        the supervisor's idle CPU).  Memory a worker allocates shows in RSS
        (read every tick), so a flat RSS means USS can have moved only by
        pages changing between shared and private (copy-on-write of template
        pages, a sibling's exit): the stale-cap still samples those.
        """
        since = now - wd.last_uss
        interval = self.settings.uss_interval_s
        if since < interval:
            return False
        return wd.uss is None or abs(rss - wd.uss_rss) >= USS_RSS_MOVED or since >= interval * USS_FLAT_FACTOR

    def _start(self, slot: "SlotState", w: "WorkerProc", now: float) -> Watched:
        det = LeakDetector(self.settings, now, budget_bytes=self._budget(),
                           requests_at_spawn=0)
        wd = Watched(detector=det, generation=w.generation, pid=w.pid, start_rss=w.rss_bytes or 0)
        self.watched[slot.plan.slot] = wd
        return wd

    # ------------------------------------------------------------------- verdicts

    def _record(self, slot: "SlotState", wd: Watched, v: Verdict) -> None:
        wd.verdict = v
        ev = msgspec.to_builtins(v.evidence)
        ev.pop("trends", None)
        entry = {"kind": v.kind, "reason": v.reason, "detail": v.detail, "streak": v.streak, "evidence": ev,
                 "generation": wd.generation, "pid": wd.pid, "ts": time.time()}
        self.last_verdicts[slot.plan.slot] = entry
        if v.kind in ("suspect", "leak", "soft_cap", "hard_cap"):
            self.history.setdefault(slot.plan.slot, deque(maxlen=8)).append(entry)
            (log.warning if v.kind != "suspect" else log.info)(
                "leak_verdict", slot=slot.plan.slot, pid=wd.pid, verdict=v.kind, reason=v.reason, detail=v.detail,
                slope_per_1000_requests=ev.get("slope_per_1000_requests"),
                ci_per_1000_requests=ev.get("ci_per_1000_requests"), p_value=ev.get("p_value"),
                flattening_ratio=ev.get("flattening_ratio"), window_requests=ev.get("window_requests"),
                rss_bytes=ev.get("rss_bytes"), uss_bytes=ev.get("uss_bytes"),
            )

    def _judge(self, slot: "SlotState", w: "WorkerProc", wd: Watched, v: Verdict, now: float) -> None:
        self._record(slot, wd, v)
        if v.kind == "hard_cap":
            reason = f"hard memory cap: {v.detail}"
            log.error("leak_kill", slot=slot.plan.slot, pid=w.pid, reason=w.kill_reason or reason)
            self.ctl.abort(w, reason, now)
            return
        if v.kind == "suspect" and v.trim:
            wd.trimming = True
            asyncio.get_running_loop().create_task(self._trim(slot, w, wd))
            return
        if v.kind in ("leak", "soft_cap"):
            self._maybe_recycle(slot, w, wd, v, now)
        elif v.kind in ("ok", "warming"):
            wd.deferred = wd.deferred_why = None   # the leak no longer shows: nothing waits any more

    async def _trim(self, slot: "SlotState", w: "WorkerProc", wd: Watched) -> None:
        try:
            res = await self.channel.broadcast_one(w, "trim", {}, timeout=10.0)
            await asyncio.sleep(0.5)
            rss = read_statm_rss(w.pid) or w.rss_bytes
            uss = read_smaps_rollup(w.pid).get("Uss")
            v = wd.detector.after_trim(time.monotonic(), rss, uss)
            log.info("leak_trim", slot=slot.plan.slot, pid=w.pid, ack=res, rss_after=rss, verdict=v.kind)
            self._record(slot, wd, v)
            if v.kind in ("leak", "soft_cap"):
                self._maybe_recycle(slot, w, wd, v, time.monotonic())
        finally:
            wd.trimming = False

    def _node_shedding(self, node: int) -> bool:
        shed = admitted = 0
        for s in self.ctl.slots.values():
            if s.plan.node != node or s.worker is None or s.worker.stats is None:
                continue
            gate = s.worker.stats.extra.get("admission") if isinstance(s.worker.stats.extra, dict) else None
            if isinstance(gate, dict):
                shed += sum(int(v) for v in (gate.get("shed") or {}).values())
                admitted += int(gate.get("admitted", 0))
                if gate.get("codel_overloaded"):
                    return True
        total = shed + admitted
        return bool(total) and shed / total > self.settings.overload_shed_fraction

    def _maybe_recycle(self, slot: "SlotState", w: "WorkerProc", wd: Watched, v: Verdict, now: float) -> None:
        node = slot.plan.node
        times = self.recycles.setdefault(node, deque())
        cap = v.kind == "soft_cap"
        cur = self.operations.current
        why = recycle_deferral(
            self.settings, now=now, node=node, times=times,
            last_worker=self.last_worker_recycle.get(slot.plan.slot, -1e18), cap=cap,
            shedding=not cap and self._node_shedding(node),
            running_op=cur.id if cur is not None and cur.state == "running" else None,
            grown_bytes=max(0, max(w.rss_bytes or 0, wd.uss or 0) - wd.start_rss),
            slots_on_node=sum(1 for x in self.ctl.slots.values() if x.plan.node == node))
        if why:
            if _shape(why) != _shape(wd.deferred_why):   # once per reason, not every tick
                log.warning("leak_recycle_deferred", slot=slot.plan.slot, pid=w.pid, verdict=v.kind, why=why)
            wd.deferred, wd.deferred_why = v, why
            return
        wd.deferred = wd.deferred_why = None
        times.append(now)
        self.last_worker_recycle[slot.plan.slot] = now
        wd.recycling = True
        reason = f"{'soft memory cap' if cap else 'leak'}: {v.detail}"
        log.warning("leak_recycle", slot=slot.plan.slot, pid=w.pid, reason=reason)
        try:
            self.operations.start(
                "leak", {"slot": slot.plan.slot, "reason": reason}, [slot.plan.slot],
                lambda op: self.operations.recycle(op, slot, reason),
            )
        except Exception as e:  # another operation won the race: try again at the next verdict
            wd.recycling = False
            log.warning("leak_recycle_deferred", slot=slot.plan.slot, why=str(e))

    def status(self, slot: "SlotState") -> dict[str, Any]:
        wd = self.watched.get(slot.plan.slot)
        v = self.last_verdicts.get(slot.plan.slot)
        return {
            "uss_bytes": wd.uss if wd else None,
            "pss_bytes": wd.pss if wd else None,
            "verdict": v["kind"] if v else None,
            "reason": v["reason"] if v else None,
            "detail": v["detail"] if v else None,
            "slope_per_1000_requests": v["evidence"].get("slope_per_1000_requests") if v else None,
            "slope_per_minute": v["evidence"].get("slope_per_minute") if v else None,
            "history": list(self.history.get(slot.plan.slot, ())),
            "budget_bytes": self.budget or None,
        }
