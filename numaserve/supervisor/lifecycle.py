"""Every slot's worker from spawn to exit: the supervision state machine.

spawn → STARTING (shown as ``loading``) → (Ready) READY → exit → classified
(``supervisor.exits``) → BACKOFF (jittered exponential delay) → spawn again,
or FAILED (crash loop, deterministic boot failure) → retried after
``failed_retry_interval``.  A kill from outside while loading is retried at
once (then paced), never FAILED.  The watchdog turns a stalled load
(``supervisor.loadwatch``: no beat, report or /proc counter moving), an
operator's ready deadline or silent heartbeats into SIGABRT then SIGKILL;
``verify`` compares what /proc shows with the plan.

``Lifecycle`` is the slot table (``slottable.SlotTable``: the state and the
verbs that change it) with these judgments on top.  No sockets here and no
process creation: a worker is started through the ``SpawnWorker`` callable
the supervisor passes in (the one seam that turns a slot plan into a running
process), and signals go through ``send_signal``, so the state machine runs
in unit tests on fake processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Callable

import structlog

from numaserve.config import Config
from numaserve.supervisor import exits as X
from numaserve.supervisor import slots as S
from numaserve.supervisor.backoff import RestartPolicy
from numaserve.supervisor.leakwatch import read_statm_rss
from numaserve.supervisor.loadwatch import LoadProgress, ProcSample, load_verdict, read_sample, read_tree_sample
from numaserve.supervisor.slottable import SendMessage, SlotTable, SpawnWorker  # noqa: F401  (SpawnWorker: re-exported)
from numaserve.progress import read_progress

log = structlog.get_logger("numaserve.supervisor")

# Exit statuses of `numaserve start` (documented in README and docs/errors.md).
EXIT_OK = 0              # graceful stop, every worker finished in time
EXIT_ERROR = 1           # fatal runtime error
EXIT_USAGE = 2           # bad config / arguments (raised before start)
EXIT_NO_SLOT = 3         # no slot could start (e.g. the app cannot import)
EXIT_FORCED = 4          # stopped, but workers had to be killed (timeout or second signal)

#: A "loading" log line per loading worker this often (elapsed, RSS, progress).
LOADING_LOG_S = 20.0

WORKER_EXIT_APP_LOAD = 3       # numaserve.worker.main.EXIT_APP_LOAD_FAILED
LAUNCH_EXIT_BIND_FAILED = 126  # numaserve.bind.launch: binding or exec failed
LAUNCH_EXIT_NOT_FOUND = 127


def process_frozen(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP/SIGTSTP: state T) or a tracer (t), not hung by itself."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def describe_exit(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    if code == WORKER_EXIT_APP_LOAD:
        return "exit 3 (app failed to load)"
    if code == LAUNCH_EXIT_BIND_FAILED:
        return "exit 126 (binding or exec failed in the launcher)"
    if code == LAUNCH_EXIT_NOT_FOUND:
        return "exit 127 (command not found)"
    return f"exit {code}"


class Lifecycle(SlotTable):
    """The slot table with the loop's own judgments: reap and classify exits, back off or fail,
    retry, watch for hangs, verify bindings, and say whether the service is ready."""

    def __init__(
        self, cfg: Config, slots: dict[int, S.SlotState], policy: RestartPolicy, *, spawn_worker: SpawnWorker,
        wake: asyncio.Event, started: float, send_message: SendMessage,
        send_signal: Callable[[int, int], None] = os.kill,
        on_spawn_error: Callable[[BaseException], None] = lambda e: None,
        on_exit: Callable[[S.WorkerProc], None] = lambda w: None,
        oom_count: Callable[[], int | None] = X.oom_kill_count,
        frozen: Callable[[int], bool] = process_frozen,
        sample: Callable[[int], ProcSample | None] = read_sample,
        tree_sample: Callable[[int], ProcSample | None] = read_tree_sample,
        cgroup_of: Callable[[int], str | None] = X.cgroup_dir,
    ) -> None:
        super().__init__(cfg, slots, spawn_worker=spawn_worker, wake=wake, started=started,
                         send_message=send_message, send_signal=send_signal, on_spawn_error=on_spawn_error,
                         cgroup_of=cgroup_of)
        self.policy = policy
        self.on_exit = on_exit
        self.oom_count = oom_count
        self.frozen = frozen
        self.sample = sample
        self.tree_sample = tree_sample
        self.fatal: str | None = None
        self.exit_code = EXIT_OK
        self.all_ready_logged = False
        self._oom_seen = oom_count()       # to tell an OOM kill from an operator's kill -9
        from numaserve.bind.verify import PlacementReader

        # re-checks read only what can have changed (new threads, CPUs; policies and
        # pages per node in turn): a full read of 32 workers costs ~0.1 s of CPU
        self.placement = PlacementReader()

    def spawn_failed(self, slot: S.SlotState, now: float, error: BaseException) -> None:
        """A spawn that raised counts as a boot failure: backoff, or the slot fails."""
        self._after_exit(slot, now, 0.0, f"spawn failed: {error}", kind=X.BOOT)

    def reap(self, now: float) -> None:
        for slot in self.slots.values():
            for w in list(slot.workers()):
                code = w.popen.poll()
                if code is not None:
                    self._exited(slot, w, code, now)

    def _exited(self, slot: S.SlotState, w: S.WorkerProc, code: int, now: float) -> None:
        uptime = now - w.started
        cause = describe_exit(code)
        reason = w.kill_reason or (f"goodbye: {w.goodbye}; {cause}" if w.goodbye and code != 0 else cause)
        w.exit_code, w.exit_cause = code, reason
        self.forget_progress(w)
        w.exit_evt.set()
        w.ready_evt.set()  # wake anyone waiting for readiness: it will not come
        self.on_exit(w)
        slot.requests_before += w.stats.requests if w.stats else 0
        slot.totals_before.add_stats(w.stats)
        expected = self.stopping or (w.stop_sent is not None and not w.kill_reason)
        if w in slot.retiring:
            slot.retiring.remove(w)
            log.info("worker_exit", slot=slot.plan.slot, pid=w.pid, generation=w.generation, exit=cause,
                     role="retiring")
            return
        if w is slot.incoming:
            slot.incoming = None
            log.warning("worker_exit", slot=slot.plan.slot, pid=w.pid, generation=w.generation, exit=reason,
                        role="incoming")
            return
        slot.worker = None
        slot.last_exit = cause
        if expected:
            log.info("worker_exit", slot=slot.plan.slot, pid=w.pid, generation=w.generation, exit=cause)
            slot.state = S.DRAINED if slot.drained else S.STOPPED
            return
        oom = False
        if code == -signal.SIGKILL and w.kill_reason is None:
            count = self.oom_count()
            oom = count is not None and self._oom_seen is not None and count > self._oom_seen
            self._oom_seen = count
            oom_note = self.cgroup_oom_note(w)
            if oom_note:
                oom = True
                reason = w.exit_cause = f"killed by SIGKILL: {oom_note}"
        verdict = X.classify_exit(code=code, was_ready=w.ready is not None, we_stopped=w.stop_sent is not None,
                                  we_killed=w.kill_reason is not None, stopped_from_outside=w.stopped_outside,
                                  goodbye=w.goodbye, oom_killed=oom)
        failed_reason = (w.goodbye or cause) if code == WORKER_EXIT_APP_LOAD and w.ready is None else None
        log.warning(
            "worker_crash",  # every unexpected exit (the event consumers know); ``kind`` says whose fault
            slot=slot.plan.slot,
            pid=w.pid,
            generation=w.generation,
            exit=cause,
            reason=reason,
            kind=verdict.kind,
            why=verdict.why,
            uptime_s=round(uptime, 3),
        )
        self._after_exit(slot, now, uptime, reason, kind=verdict.kind, code=code, failed_reason=failed_reason)

    def _after_exit(
        self, slot: S.SlotState, now: float, uptime: float, reason: str, *, kind: str,
        code: int | None = None, failed_reason: str | None = None,
    ) -> None:
        """Account for an unexpected exit (``kind`` from ``supervisor.exits``) and
        decide: restart after a delay, or mark the slot failed (retried later)."""
        external = kind == X.EXTERNAL
        delay, looping = slot.restart.record_exit(now, uptime, external=external)
        slot.restarts += 1
        slot.down_since = slot.down_since or now
        slot.last_restart_reason = reason
        slot.last_exit_kind = kind
        cls = S.restart_reason_class(reason)
        totals = slot.totals_before
        totals.restarts_by_reason[cls] = totals.restarts_by_reason.get(cls, 0) + 1
        totals.exits_by_kind[kind] = totals.exits_by_kind.get(kind, 0) + 1
        boot_failure = kind == X.BOOT and code in (WORKER_EXIT_APP_LOAD, LAUNCH_EXIT_BIND_FAILED, LAUNCH_EXIT_NOT_FOUND)
        # At start-up (no slot has served yet) a deterministic boot failure is
        # final for the slot, so a broken app fails fast with its reason; a
        # retry of a failed slot gets one attempt before it is failed again.
        never_served = not any(s.ever_ready for s in self.slots.values())
        if looping or (boot_failure and never_served) or (slot.retrying and not external):
            self._fail_slot(slot, now, failed_reason or reason)
            return
        slot.state = S.BACKOFF
        slot.next_start = now + delay
        log.info("backoff", slot=slot.plan.slot, delay_s=round(delay, 3), consecutive=slot.restart.consecutive,
                 kind=kind)

    def _fail_slot(self, slot: S.SlotState, now: float, reason: str) -> None:
        """Out of service until ``supervisor.failed_retry_interval`` passes (or ``restart --slot``)."""
        slot.state = S.FAILED
        slot.failed_reason = reason
        slot.retrying = False
        slot.next_retry = now + slot.restart.retry_delay()
        log.error(
            "slot_failed",
            slot=slot.plan.slot,
            reason=reason,
            crashes_in_window=len(slot.restart.crashes),
            window_s=self.policy.loop_window,
            retry_in_s=round(slot.next_retry - now, 1),
        )

    def check_boot_failure(self) -> None:
        """No slot could ever start: every slot failed before any was ever ready.

        Once any slot has served, the supervisor never gives up: failed slots
        are retried on ``supervisor.failed_retry_interval``.
        """
        states = [s.state for s in self.slots.values()]
        if states and all(st == S.FAILED for st in states) and not any(s.ever_ready for s in self.slots.values()):
            reasons = sorted({s.failed_reason or "unknown" for s in self.slots.values()})
            self.fatal = "no slot could start: " + "; ".join(reasons)
            self.exit_code = EXIT_NO_SLOT

    def restart_due(self, now: float) -> None:
        for slot in self.slots.values():
            if slot.worker is not None or slot.drained:
                continue
            if slot.state == S.BACKOFF and now >= slot.next_start:
                self.start_worker(slot, now)
            elif slot.state == S.FAILED and slot.next_retry is not None and now >= slot.next_retry:
                log.info("slot_retry", slot=slot.plan.slot, after=slot.failed_reason)
                slot.retrying = True
                self.start_worker(slot, now)

    def watchdog(self, now: float) -> None:
        sup = self.cfg.supervisor
        for slot in self.slots.values():
            for w in list(slot.workers()):
                if w.popen.poll() is not None or w.kill_sent is not None:
                    continue
                if w.abort_sent is not None:
                    if now - w.abort_sent >= sup.abort_grace:
                        log.warning("kill", slot=slot.plan.slot, pid=w.pid, reason="did not exit after SIGABRT")
                        self.kill(w, now)
                    continue
                if w.stop_sent is not None:
                    if now - w.stop_sent >= w.stop_deadline + sup.stop_timeout:
                        log.warning("kill", slot=slot.plan.slot, pid=w.pid, generation=w.generation,
                                    reason=f"did not stop within {w.stop_deadline:g}s")
                        self.kill(w, now)
                        self.forced_kills = self.forced_kills or self.stopping
                    continue
                if self.stopping or w in slot.retiring:
                    continue
                self._responsiveness(slot, w, now)
                reason = None
                if w.ready is None and not w.external:
                    reason = self.loading_verdict(slot, w, now)
                elif w.ready is None:   # --cmd: no beats; the operator's deadline, else its process tree
                    if sup.ready_timeout > 0:
                        if now - w.started > sup.ready_timeout:
                            reason = f"not ready within {sup.ready_timeout:g}s (supervisor.ready_timeout)"
                    else:   # no deadline: a command whose processes all stand still never becomes ready
                        reason = self.loading_verdict(slot, w, now, tree=True)
                    if reason and w.probe_note:
                        reason += f" (last probe: {w.probe_note})"
                elif not w.external and w.last_beat is not None and now - w.last_beat > sup.heartbeat_timeout:
                    reason = f"hung: no heartbeat for {now - w.last_beat:.1f}s (timeout {sup.heartbeat_timeout:g}s)"
                if reason:
                    w.stopped_outside = w.stopped_outside or self.frozen(w.pid)
                    if w.stopped_outside and not reason.startswith("frozen from outside"):
                        reason = f"frozen from outside (SIGSTOP): {reason}"
                    w.kill_reason = reason
                    w.abort_sent = now
                    log.warning("hang", slot=slot.plan.slot, pid=w.pid, generation=w.generation, reason=reason)
                    # SIGABRT first (a Python worker dumps its stack via faulthandler);
                    # a stopped (SIGSTOP) process only dies from SIGKILL, which follows.
                    self.signal(w, signal.SIGABRT)

    def loading_verdict(self, slot: S.SlotState, w: S.WorkerProc, now: float, *, tree: bool = False) -> str | None:
        """Gather a loading worker's signs of life (beats, its progress file, /proc) and judge them.

        ``tree``: read /proc over the process and its descendants (a ``--cmd`` server)."""
        sup = self.cfg.supervisor
        if w.load is None:
            w.load = LoadProgress.begin(w.started)
        p = w.load
        p.heard(now, w.last_beat)
        if w.progress_path:
            data = read_progress(w.progress_path)
            if data is not None:
                p.heard(now, data["beat"], "load beat")
                p.report(now, data["at"], data["fraction"], data["note"])
        p.observe(now, (self.tree_sample if tree else self.sample)(w.pid))
        if p.log_due(now, LOADING_LOG_S):
            log.info("loading", slot=slot.plan.slot, pid=w.pid, generation=w.generation,
                     elapsed_s=round(now - p.started, 1), rss_bytes=p.sample.rss_bytes if p.sample else None,
                     fraction=p.fraction, note=p.note or None, last_sign=p.sign,
                     last_sign_s=round(now - p.last_sign, 1))
        return load_verdict(p, now, stall_after=sup.heartbeat_timeout, deadline=sup.ready_timeout)

    def cgroup_oom_note(self, w: S.WorkerProc) -> str | None:
        """When the worker's cgroup counted an OOM kill since it started: say so, with the limit
        and the peak RSS the supervisor saw (None otherwise, or when the cgroup is unknown)."""
        if not w.cgroup or w.oom_base is None:
            return None
        count = X.cgroup_oom_kills(w.cgroup)
        if count is None or count <= w.oom_base:
            return None
        peak = max(w.rss_bytes, w.load.peak_rss if w.load else 0)
        limit = X.cgroup_memory_max(w.cgroup) or "?"
        return (f"OOM-killed (memory.events oom_kill {w.oom_base} -> {count} in {w.cgroup}; "
                f"memory.max {limit}; peak RSS seen {peak / 1048576:.0f} MiB)")

    def all_down(self) -> bool:
        """No slot serves and every slot that should has failed since it last served (or ever)."""
        slots = [s for s in self.slots.values() if not s.drained]
        return bool(slots) and all(s.state != S.READY and s.down_since is not None for s in slots)

    def unresponsive_after(self) -> float:
        sup = self.cfg.supervisor
        return min(2.0 * sup.heartbeat_interval, sup.heartbeat_timeout)

    def _responsiveness(self, slot: S.SlotState, w: S.WorkerProc, now: float) -> None:
        """A serving worker that misses heartbeats leaves steering at once; the
        kill (``heartbeat_timeout``) comes later and only if it stays silent."""
        if w.ready is None or w.external or w.last_beat is None:
            return
        silent = now - w.last_beat
        if silent > self.unresponsive_after():
            if w.unresponsive_since is None:
                w.unresponsive_since = now
                w.stopped_outside = self.frozen(w.pid)
                log.warning("unresponsive", slot=slot.plan.slot, pid=w.pid, generation=w.generation,
                            silent_s=round(silent, 3), frozen=w.stopped_outside,
                            action="no new connections; queued ones handed to serving slots")
                self.wake.set()
        elif w.unresponsive_since is not None:
            log.info("responsive_again", slot=slot.plan.slot, pid=w.pid, generation=w.generation,
                     away_s=round(now - w.unresponsive_since, 3))
            w.unresponsive_since = None
            w.stopped_outside = False

    def verify(self, now: float) -> None:
        from numaserve.bind.verify import check_placement

        interval = self.cfg.supervisor.verify_interval
        checked = False
        for slot, w in [(sl, w) for sl in self.slots.values() for w in sl.workers()]:
            first = w.verified_at is None and (w.hello is not None or (w.external and now - w.started > 0.5))
            due = w.verified_at is not None and interval > 0 and now - w.verified_at >= interval
            if not (first or due) or w.popen.poll() is not None:
                continue
            checked = True
            try:
                observed = self.placement.read(w.pid, fresh=first)  # a reused pid starts afresh
                ok, problems = check_placement(
                    observed, cpus=slot.plan.cpus, mempolicy=slot.plan.mempolicy, nodes=slot.plan.memory_nodes
                )
                if slot.plan.memory_nodes:
                    share = observed.remote_share(slot.plan.memory_nodes)
                    w.remote_share = None if share is None else round(share, 4)
            except (OSError, ValueError) as e:
                ok, problems = False, [f"could not read /proc/{w.pid}: {e}"]
            if w is not slot.worker:   # the leak watch reads the serving worker's statm every second
                w.rss_bytes = read_statm_rss(w.pid) or w.rss_bytes
            changed = w.verified != ok or w.verify_problems != problems
            w.verified, w.verify_problems, w.verified_at = ok, problems, now
            if changed:
                if ok:
                    log.info("binding_verified", slot=slot.plan.slot, pid=w.pid)
                else:
                    log.error("binding_mismatch", slot=slot.plan.slot, pid=w.pid, problems=problems)
        if checked:
            self.placement.forget(w.pid for sl in self.slots.values() for w in sl.workers()
                                  if w.popen.poll() is None)

    def readiness(self, now: float, state: str) -> str:
        """The service state after this tick: running (all ready), degraded, or still starting."""
        slots = list(self.slots.values())
        if all(s.state == S.READY for s in slots):
            if not self.all_ready_logged:
                self.all_ready_logged = True
                log.info("ready", slots=len(slots), startup_s=round(now - self.started, 3))
            return "running"
        if self.all_down():
            if state != "failed":
                log.error("service_failed", note="no slot is serving; every slot keeps being retried",
                          slots={str(s.plan.slot): s.failed_reason or s.last_restart_reason for s in slots})
            return "failed"
        if state == "failed":
            return "degraded" if any(s.state == S.READY for s in slots) else "starting"
        if state == "starting":
            # boot settled with some slots failed and the rest serving: that is
            # a state to report (READY=1, STATUS, /readyz), not to wait out
            if any(s.state == S.READY for s in slots) and all(s.state in (S.READY, S.FAILED) for s in slots):
                log.warning("ready_degraded", serving=[s.plan.slot for s in slots if s.state == S.READY],
                            failed={str(s.plan.slot): s.failed_reason for s in slots if s.state == S.FAILED},
                            startup_s=round(now - self.started, 3))
                return "degraded"
            return state
        return "degraded" if state == "running" else state
