"""Per-slot and per-worker state the supervision loop keeps (plain data)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from numaserve.control.messages import Placement, Stats
from numaserve.bind.placement import SlotPlan
from numaserve.supervisor.backoff import RestartState
from numaserve.refusals import public_reason
from numaserve.supervisor.loadwatch import LoadProgress
from numaserve.supervisor.workerproc import WorkerProcess

# Slot states, in the order an operator usually sees them.
STARTING = "starting"      # worker spawned, not Ready yet
LOADING = "loading"        # shown for STARTING while a worker (or its node's template) loads the app
READY = "ready"            # worker serving
BACKOFF = "backoff"        # waiting to restart after an exit
FAILED = "failed"          # crash loop or boot failure: retried only after supervisor.failed_retry_interval
STOPPING = "stopping"      # asked to stop
STOPPED = "stopped"
DRAINING = "draining"      # operator drain in progress: no new connections, in-flight finishing
DRAINED = "drained"        # taken out of service by the operator: listener kept, no worker


@dataclass
class Totals:
    """Monotonic per-slot counters summed over every generation (for metrics:
    a worker restart must not look like a counter reset)."""

    status_classes: dict[str, int] = field(default_factory=dict)
    latency_buckets: list[int] = field(default_factory=list)
    latency_count: int = 0
    latency_sum_ms: float = 0.0
    restarts_by_reason: dict[str, int] = field(default_factory=dict)
    connections: dict[str, int] = field(default_factory=dict)   # local / remote / unknown
    shed: int = 0
    shed_by_reason: dict[str, int] = field(default_factory=dict)
    exits_by_kind: dict[str, int] = field(default_factory=dict)  # supervisor.exits kinds: external, crash, boot, hang

    def add_stats(self, stats: Stats | None) -> None:
        if stats is None:
            return
        self.shed += int(stats.shed or 0)
        gate = stats.extra.get("admission") if isinstance(stats.extra, dict) else None
        if isinstance(gate, dict) and isinstance(gate.get("shed"), dict):
            for k, v in gate["shed"].items():   # (a worker of an older release: its names mapped)
                k = public_reason(str(k))
                self.shed_by_reason[k] = self.shed_by_reason.get(k, 0) + int(v)
        if isinstance(stats.extra, dict):
            for k in ("local", "remote", "unknown"):
                v = stats.extra.get(f"connections_{k}")
                if isinstance(v, int):
                    self.connections[k] = self.connections.get(k, 0) + v
        for k, v in stats.status_classes.items():
            self.status_classes[k] = self.status_classes.get(k, 0) + int(v)
        b = stats.extra.get("latency_buckets") if isinstance(stats.extra, dict) else None
        if isinstance(b, list):
            if len(self.latency_buckets) < len(b):
                self.latency_buckets.extend([0] * (len(b) - len(self.latency_buckets)))
            for i, v in enumerate(b):
                self.latency_buckets[i] += int(v)
            self.latency_count += int(stats.extra.get("latency_count", 0))
            self.latency_sum_ms += float(stats.extra.get("latency_sum_ms", 0.0))

    def combined(self, *stats: Stats | None) -> dict[str, Any]:
        """These totals plus the live workers' own counters (current, incoming, retiring)."""
        t = Totals(dict(self.status_classes), list(self.latency_buckets), self.latency_count,
                   self.latency_sum_ms, dict(self.restarts_by_reason), dict(self.connections), self.shed,
                   dict(self.shed_by_reason), dict(self.exits_by_kind))
        for st in stats:
            t.add_stats(st)
        known = t.connections.get("local", 0) + t.connections.get("remote", 0)
        return {
            "connections": t.connections,
            "locality_share": round(t.connections.get("local", 0) / known, 4) if known else None,
            "status_classes": t.status_classes,
            "latency_buckets": t.latency_buckets,
            "latency_count": t.latency_count,
            "latency_sum_ms": round(t.latency_sum_ms, 3),
            "restarts_by_reason": t.restarts_by_reason,
            "exits_by_kind": t.exits_by_kind,
            "shed": t.shed,
            "shed_by_reason": t.shed_by_reason,
        }


def restart_reason_class(reason: str) -> str:
    """A small fixed vocabulary for metrics labels (the full reason is in status/logs)."""
    r = reason.lower()
    for key in ("hung", "not ready", "sigkill", "sigabrt", "sigsegv", "app failed", "spawn failed", "binding",
                "leak", "soft cap", "hard cap", "reload", "restart"):
        if key in r:
            return key.replace(" ", "_")
    if r.startswith("exit") or "exit " in r:
        return "exit"
    return "other"


@dataclass
class WorkerProc:
    generation: int
    popen: WorkerProcess                # exec'd (Popen) or forked from a node template (ForkedProcess)
    started: float                      # monotonic
    external: bool = False              # --cmd worker: no control channel
    identity: bytes | None = None       # ZeroMQ routing id once Hello arrived
    token: str | None = None            # per-spawn secret its Hello must carry (workerauth)
    hello: float | None = None
    ready: float | None = None
    last_beat: float | None = None
    loop_lag: float = 0.0
    placement: Placement | None = None  # what the worker saw from inside
    verified: bool | None = None        # what the supervisor saw from outside
    verify_problems: list[str] = field(default_factory=list)
    verified_at: float | None = None
    remote_share: float | None = None   # resident memory not on the slot's memory nodes (numa_maps)
    stats: Stats | None = None
    rss_bytes: int = 0
    stop_sent: float | None = None
    abort_sent: float | None = None
    kill_sent: float | None = None
    kill_reason: str | None = None      # set when *we* decided it must die (hang, boot timeout)
    stopped_outside: bool = False       # the watchdog found it frozen by SIGSTOP, not hung by itself
    unresponsive_since: float | None = None  # missed heartbeats (or probes): out of steering until back
    probe_note: str | None = None       # --cmd readiness: what the last probe saw
    goodbye: str | None = None
    stop_deadline: float = 0.0          # seconds it was given to finish (Stop/Drain)
    exit_code: int | None = None
    exit_cause: str | None = None
    env: dict[str, str] = field(default_factory=dict)   # what numaserve set (thread pools, GPUs, [env])
    progress_path: str | None = None    # its numaserve.progress file while it loads
    load: LoadProgress | None = None    # signs of life until Ready (supervisor.loadwatch)
    cgroup: str | None = None           # its cgroup v2 directory, read while it lives (OOM accounting)
    oom_base: int | None = None         # that cgroup's memory.events oom_kill when it started
    ready_evt: asyncio.Event = field(default_factory=asyncio.Event)
    exit_evt: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def pid(self) -> int:
        return self.popen.pid


@dataclass
class SlotState:
    plan: SlotPlan
    restart: RestartState
    state: str = STARTING
    worker: WorkerProc | None = None
    generation: int = 0
    restarts: int = 0
    last_restart_reason: str | None = None
    last_exit: str | None = None
    next_start: float = 0.0
    failed_reason: str | None = None
    next_retry: float | None = None     # failed: when it is tried again (monotonic)
    retrying: bool = False              # this start is a retry of a failed slot: one failure sends it back
    last_exit_kind: str | None = None   # supervisor.exits kind of the last unexpected exit
    ever_ready: bool = False
    requests_before: int = 0            # requests served by earlier generations
    totals_before: "Totals" = field(default_factory=lambda: Totals())
    drained: bool = False               # operator drained: no new connections, no worker
    incoming: WorkerProc | None = None  # next generation during a rolling replace
    retiring: list[WorkerProc] = field(default_factory=list)  # old generations draining out
    operation: str | None = None        # id of the operation working on this slot
    down_since: float | None = None     # unexpected exit since it last served: counts towards "all slots down"

    def workers(self) -> Iterator[WorkerProc]:
        """Every live-or-unreaped worker of the slot: current, incoming, retiring."""
        if self.worker is not None:
            yield self.worker
        if self.incoming is not None:
            yield self.incoming
        yield from list(self.retiring)

    def settled(self) -> bool:
        """One serving worker and nothing in motion: no start, restart, stop, drain, hand-over or
        missed heartbeats that the supervision loop must time to a fraction of a second."""
        w = self.worker
        return (self.state == READY and not self.drained and self.incoming is None and not self.retiring
                and self.operation is None and w is not None and not w.external and w.ready is not None
                and w.hello is not None and w.verified_at is not None and w.last_beat is not None
                and w.stop_sent is None and w.abort_sent is None and w.kill_sent is None
                and w.unresponsive_since is None)

    def shown_state(self) -> str:
        """The state operators see: ``loading`` while a Python worker is spawned but not Ready."""
        w = self.worker
        if self.state == STARTING and w is not None and not w.external and w.ready is None:
            return LOADING
        return self.state

    def find(self, generation: int) -> WorkerProc | None:
        for w in self.workers():
            if w.generation == generation:
                return w
        return None

    def status(self, now: float | None = None) -> dict[str, Any]:
        now = time.monotonic() if now is None else now
        w = self.worker
        stats = w.stats if w else None
        return {
            "slot": self.plan.slot,
            "node": self.plan.node,
            "index": self.plan.index,
            "pid": w.pid if w else None,
            # the serving worker's generation (after a failed reload: the old one's), not the counter
            "generation": w.generation if w else None,
            "generations_started": self.generation,
            "state": self.shown_state(),
            "loading": w.load.to_json(now) if w and w.ready is None and w.load and not w.external else None,
            "cpus": list(self.plan.cpus),
            "mempolicy": self.plan.mempolicy,
            "memory_nodes": list(self.plan.memory_nodes),
            "gpus": list(self.plan.gpus),
            "binding_verified": w.verified if w else None,
            "binding_problems": list(w.verify_problems) if w else [],
            "remote_memory_share": w.remote_share if w else None,
            "worker_placement": (
                {"cpus": w.placement.cpus, "mempolicy": w.placement.mempolicy, "ok": w.placement.ok,
                 "problems": w.placement.problems}
                if w and w.placement else None
            ),
            "rss_bytes": w.rss_bytes if w else 0,
            "uptime_s": round(now - w.started, 3) if w else 0.0,
            "ready_s": round(now - w.ready, 3) if w and w.ready else None,
            "restarts": self.restarts,
            "last_restart_reason": self.last_restart_reason,
            "last_exit": self.last_exit,
            "failed_reason": self.failed_reason,
            "last_exit_kind": self.last_exit_kind,
            "retry_in_s": round(max(0.0, self.next_retry - now), 1) if self.next_retry is not None else None,
            "unresponsive_s": (round(now - w.last_beat, 3) if w.last_beat else None)
            if w and w.unresponsive_since is not None else None,
            "probe": w.probe_note if w and w.external else None,
            "requests": self.requests_before + (stats.requests if stats else 0),
            "inflight": stats.inflight if stats else 0,
            "connections": stats.connections if stats else 0,
            "latency_ms": dict(stats.latency_ms) if stats else {},
            "status_classes": dict(stats.status_classes) if stats else {},
            "totals": self.totals_before.combined(*(x.stats for x in self.workers())),
            "env": dict(w.env) if w else {},
            "loop_lag_s": round(w.loop_lag, 4) if w else None,
            "last_heartbeat_s": round(now - w.last_beat, 3) if w and w.last_beat else None,
            "external": w.external if w else None,
            "drained": self.drained,
            "incoming": {"pid": self.incoming.pid, "generation": self.incoming.generation,
                         "ready": self.incoming.ready is not None} if self.incoming else None,
            "retiring": [{"pid": r.pid, "generation": r.generation,
                          "inflight": r.stats.inflight if r.stats else None} for r in self.retiring],
            "operation": self.operation,
        }
