"""Worker entry point: ``python -m numaserve.worker`` (started by the supervisor).

The process is already bound (CPU affinity + memory policy) when this runs.
Lifecycle: spec -> logging -> self-check -> control channel + Hello -> load
app -> serve on the inherited fd -> Ready -> heartbeats/stats/commands ->
Stop/Drain/SIGTERM -> Goodbye -> exit status.

Exit status is part of the supervisor contract: 0 normal stop, 1 unexpected
error (also: orphaned), 3 app load or lifespan startup failure (a boot
failure, not a crash: restarting will not help until something changes).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import sys
import time
from typing import Any

import structlog
import structlog.tracebacks

from numaserve.control.messages import Goodbye, Heartbeat, Hello, Placement, Ready, Stats, encode
from numaserve.worker.appload import AppLoadError, describe_exception, failure_line, load_app
from numaserve.worker.cache import ResponseCache
from numaserve.control.workerauth import take_token
from numaserve.worker.control import CommandDispatcher, ControlChannel, beat_phase, next_beat_due, worker_identity
from numaserve.worker.fdwatch import FdWatch
from numaserve.worker.edge import LifespanRecord, build_stack
from numaserve.worker.serve import WorkerServer, loop_factory, open_listener
from numaserve.worker.preload import PreloadError, run_preload
from numaserve.progress import LoadBeat
from numaserve.worker.sniff import frame_stats
from numaserve.worker.spec import WorkerSpec, spec_from_env
from numaserve.worker.stats import StatsDedup, WorkerStats

__all__ = [
    "EXIT_APP_LOAD_FAILED",
    "EXIT_ERROR",
    "EXIT_OK",
    "IDLE_GRACE",
    "LATENCY_WINDOW_S",
    "Worker",
    "check_placement",
    "main",
    "run_worker",
]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_APP_LOAD_FAILED = 3  # same value as uvicorn's STARTUP_FAILURE; supervisor: boot failure

#: On Stop/Drain, connections we already accepted get this long (bounded by
#: the deadline) to send one more request, answered with ``Connection: close``,
#: before idle ones are closed.  Covers the accepted-but-not-yet-read race so
#: a connection taken off the shared accept queue is not dropped unanswered.
IDLE_GRACE = 0.5

#: Percentiles in Stats cover about this many seconds of recent requests.
LATENCY_WINDOW_S = 10.0

_ORPHAN_DEADLINE = 5.0
_POLL = 0.05


def check_placement(spec: WorkerSpec) -> Placement:
    """Observe our own binding; prefer ``numaserve.bind.verify``, else affinity only."""
    try:
        from numaserve.bind.verify import check_self  # type: ignore[attr-defined]
    except ImportError:
        check_self = None
    if check_self is not None:
        try:
            ok, problems, observed, token = check_self(spec.cpus, spec.mempolicy, spec.memory_nodes)
            return Placement(cpus=sorted(int(c) for c in observed), mempolicy=str(token),
                             ok=bool(ok), problems=[str(p) for p in problems])
        except Exception as e:  # noqa: BLE001 - a broken checker must not stop serving
            extra = [f"verify failed: {describe_exception(e)}"]
    else:
        extra = ["mempolicy not checked: verify module missing"]
    observed_cpus = sorted(os.sched_getaffinity(0))
    problems = list(extra)
    ok = True
    if spec.cpus and set(observed_cpus) != set(spec.cpus):
        ok = False
        problems.append(f"cpu affinity {observed_cpus} differs from planned {sorted(spec.cpus)}")
    return Placement(cpus=observed_cpus, mempolicy="unchecked", ok=ok, problems=problems)


class Worker:
    """One worker process's async lifecycle (see module docstring)."""

    def __init__(self, spec: WorkerSpec, log: Any, token: str = "") -> None:
        self.spec = spec
        self.log = log
        self.token = token  # the spawn secret Hello proves us with (numaserve.control.workerauth)
        self.fdwatch = FdWatch(log)
        self.pid = os.getpid()
        self.ppid = os.getppid()
        slots = max(1, round(LATENCY_WINDOW_S / max(spec.stats_interval, 0.01)))
        self.stats = WorkerStats(window_slots=slots)
        self.lifespan = LifespanRecord()
        self.channel: ControlChannel | None = None
        self.dispatcher: CommandDispatcher | None = None
        self.server: WorkerServer | None = None
        self.admission: Any = None  # the Edge when [admission] enabled (its gate, rt, snapshot)
        self.cache: ResponseCache | None = ResponseCache(spec.cache) if spec.cache.enabled else None
        self.orphaned = False
        self._stop_deadline: float | None = None  # time.monotonic() value
        self._stop_reason: str | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopper: asyncio.Task[None] | None = None
        self._sentinel_start: Any = None  # starts the admission sentinel once serving
        self._stats_in_beats = False      # set once serving (``_start_stats``)
        self._load_beat = LoadBeat(spec.heartbeat_interval)  # signs of life while the app loads

    # --- actions (called by the dispatcher, SIGTERM, the orphan check) ---------

    def request_stop(self, deadline: float, reason: str) -> None:
        """Graceful stop: stop accepting, let in-flight finish within ``deadline`` s."""
        self._begin_stop(deadline, reason)

    def request_drain(self, deadline: float) -> None:
        """Same sequence as stop; the worker exits as soon as in-flight reaches 0."""
        self._begin_stop(deadline, "drained")

    def set_limits(self, args: dict[str, Any]) -> tuple[bool, str]:
        """Apply limits pushed by the supervisor (carries an epoch; stale epochs refused)."""
        if self.admission is None:
            return False, "admission disabled in this worker"
        try:
            epoch = int(args["epoch"])
            kw: dict[str, Any] = {}
            for key in ("rate", "burst", "concurrency", "safe_concurrency"):
                if args.get(key) is not None:
                    kw[key] = float(args[key]) if key in ("rate", "burst") else int(args[key])
            if args.get("lease_s") is not None:
                kw["lease_expiry"] = time.monotonic() + float(args["lease_s"])
        except (KeyError, TypeError, ValueError) as e:
            return False, f"bad set_limits arguments: {e}"
        gate = self.admission.gate   # the pure CpuGate, on this loop
        ok = gate.set_limits(self.admission.rt.clock(), epoch, **kw)
        current = gate.epoch
        return ok, f"epoch {epoch} {'applied' if ok else 'stale: kept ' + str(current)}"

    def _begin_stop(self, deadline: float, reason: str) -> None:
        end = time.monotonic() + deadline
        if self._stop_deadline is None:
            self._stop_deadline = end
            self._stop_reason = reason
            self.stats.draining = True
            self.log.info("stop_requested", reason=reason, deadline=deadline)
            self._stopper = asyncio.get_running_loop().create_task(self._stop_sequence())
        else:  # a second request can only tighten the deadline; Stop wins over Drain
            self._stop_deadline = min(self._stop_deadline, end)
            if reason != "drained":
                self._stop_reason = reason

    def _stop_sentinel(self) -> None:
        rt = getattr(self.admission, "rt", None)
        if rt is not None:
            rt.stop_sentinel()
            rt.probe.stop()

    def _remaining(self) -> float:
        assert self._stop_deadline is not None
        return self._stop_deadline - time.monotonic()

    async def _stop_sequence(self) -> None:
        """Stop accepting -> idle grace -> close idle conns -> wait in-flight and
        websockets until the deadline -> websockets closed 1001 -> uvicorn shutdown."""
        server = self.server
        if server is None:  # not serving yet: run() checks the deadline before serving
            return
        server.stop_accepting()
        self._stop_sentinel()
        grace_end = time.monotonic() + min(IDLE_GRACE, max(0.0, self._remaining()) / 2)
        while server.connection_count > server.websocket_count and time.monotonic() < grace_end:
            await asyncio.sleep(_POLL)
        closed = server.shutdown_connections()
        while (self.stats.inflight > 0 or server.connection_count > 0) and self._remaining() > 0:
            await asyncio.sleep(_POLL)
        websockets = server.close_websockets(1001, "server shutting down")
        self.log.info("stop_draining_done", inflight=self.stats.inflight,
                      connections=server.connection_count, shut_down=closed,
                      websockets_closed=websockets)
        server.config.timeout_graceful_shutdown = max(0.05, self._remaining())  # type: ignore[assignment]
        server.should_exit = True

    # --- messages ----------------------------------------------------------------

    def _post(self, msg: Any) -> None:
        if self.channel is not None:
            self.channel.post(msg)

    def _on_started(self) -> None:
        self._load_beat.stop()
        if self._stop_deadline is not None:
            return
        if self._sentinel_start is not None:
            self._sentinel_start()
        self._post(Ready(slot=self.spec.slot, generation=self.spec.generation))
        self.log.info("ready")

    async def _heartbeat_loop(self) -> None:
        """Beats come from the event loop itself, so a blocked loop stops them.

        ``loop_lag`` is measured against the time the beat was due, and the
        next due time is taken from the same clock reading, so a stall
        anywhere in the cycle shows up in the next beat.  Once serving, a
        beat carries the stats when they are due (``_stats_in_beats``): one
        message per worker per interval instead of two, which is most of the
        supervisor's idle work with many workers.  Stats that did not change
        since the last ones sent (an idle worker) stay off the beat
        (``StatsDedup``, refreshed every 10th time).

        Beats fall on a grid of the shared monotonic clock (``next_beat_due``,
        a small per-slot phase), so all workers' beats of one interval reach
        the supervisor together and it reads them in one wake-up.
        """
        interval = self.spec.heartbeat_interval
        spec = self.spec
        phase = beat_phase(spec.slot)
        due = next_beat_due(time.monotonic(), interval, phase)
        last_stats = -1e18
        dedup = StatsDedup()
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            lag = max(0.0, now - due)
            due = next_beat_due(now, interval, phase)
            stats = None
            if self._stats_in_beats and now - last_stats >= spec.stats_interval - interval / 2:
                last_stats = now
                try:
                    stats = self._stats_message()
                    if not dedup.due(encode(stats)):
                        stats = None
                except Exception:  # noqa: BLE001 - a stats bug must not stop the beats (the hang detector)
                    self.log.exception("stats_failed")
            self._post(Heartbeat(slot=spec.slot, generation=spec.generation, loop_lag=lag, mono=now, stats=stats))
            if os.getppid() != self.ppid and not self.orphaned:
                self.orphaned = True
                self.log.error("supervisor_gone", ppid=self.ppid, now_ppid=os.getppid())
                self.request_stop(min(spec.graceful_timeout, _ORPHAN_DEADLINE), "supervisor gone")

    def _start_stats(self) -> None:
        """Stats ride on the beats when they are due no more often; else their own loop."""
        if self.spec.stats_interval >= self.spec.heartbeat_interval:
            self._stats_in_beats = True
        else:
            self._spawn(self._stats_loop())

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.spec.stats_interval)
            self._post(self._stats_message())

    def _stats_message(self) -> Stats:
        spec = self.spec
        server = self.server
        conns = server.connection_count if server is not None else 0
        self.fdwatch.sample(conns)
        snap = self.stats.snapshot(connections=conns)
        extra = snap["extra"]
        extra.update(self.fdwatch.extra())
        if self.dispatcher is not None:
            extra["control_bad_frames"] = self.dispatcher.bad_frames
        if self.channel is not None:
            extra["control_dropped"] = self.channel.dropped
        extra.update(frame_stats())
        if self.cache is not None:
            extra.update(self.cache.stats())
        if self.admission is not None:
            gate = self.admission.snapshot()
            extra["admission"] = gate
            snap["queued"] = gate["queued"]
            snap["shed"] = sum(gate["shed"].values())
            for code, n in (gate.get("unserved_by_status") or {}).items():  # answered by the protocol/sentinel
                cls = f"{code[0]}xx"
                snap["status_classes"][cls] = snap["status_classes"].get(cls, 0) + n
                snap["requests"] += n
            snap["limits_epoch"] = gate["epoch"]
        return Stats(slot=spec.slot, generation=spec.generation, **snap)

    async def _recv_loop(self) -> None:
        assert self.channel is not None and self.dispatcher is not None
        while True:
            try:
                frame = await self.channel.recv()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - keep serving without control rather than die
                self.log.warning("control_recv_failed", error=describe_exception(e))
                await asyncio.sleep(0.5)
                continue
            try:
                self.dispatcher.handle_frame(frame)
            except Exception:  # noqa: BLE001
                self.log.exception("control_handler_failed")

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(self._task_done)
        self._tasks.append(task)

    def _task_done(self, task: "asyncio.Task[None]") -> None:
        """A dead heartbeat loop would look like a hang: at least say why in the log."""
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.log.error("background_task_failed", task=task.get_coro().__qualname__,
                           error=describe_exception(exc), exc_info=exc)

    # --- lifecycle ---------------------------------------------------------------

    async def run(self) -> int:
        """Run to completion; always says Goodbye; returns the exit status."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.request_stop,
                                self.spec.graceful_timeout, "stopped: SIGTERM")
        loop.set_exception_handler(self.fdwatch.exception_handler)  # accept() at EMFILE is reported here
        try:
            code, reason = await self._run()
        except Exception as e:  # noqa: BLE001
            self.log.exception("worker_failed")
            code, reason = EXIT_ERROR, f"error: {describe_exception(e)}"
        finally:
            tasks = self._tasks + ([self._stopper] if self._stopper else [])
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._load_beat.stop()
            self._stop_sentinel()
            loop.remove_signal_handler(signal.SIGTERM)
        self._post(Goodbye(slot=self.spec.slot, generation=self.spec.generation, reason=reason))
        self.log.info("goodbye", reason=reason, exit_code=code)
        if self.channel is not None:
            self.channel.close(linger_ms=500)
        return code

    async def _run(self) -> tuple[int, str]:
        spec = self.spec
        placement = check_placement(spec)
        if not placement.ok or placement.problems:
            self.log.warning("placement_problems", ok=placement.ok, problems=placement.problems,
                             cpus=placement.cpus, mempolicy=placement.mempolicy)
        self.channel = ControlChannel(spec.control,
                                      worker_identity(spec.slot, spec.generation, self.pid))
        self.dispatcher = CommandDispatcher(spec.slot, spec.generation, self, self.channel.post,
                                            log_debug=self.log.debug)
        self._post(Hello(slot=spec.slot, generation=spec.generation, pid=self.pid,
                         placement=placement, token=self.token))
        self._spawn(self._recv_loop())
        self._spawn(self._heartbeat_loop())
        self._load_beat.start()  # the import below may hold this thread (and the GIL) for minutes

        socks = []
        for fd in [spec.fd, *spec.extra_fds]:
            try:
                socks.append(open_listener(fd))
            except OSError as e:
                self.log.error("listener_unusable", fd=fd, error=describe_exception(e))
                for s in socks:
                    s.close()
                return EXIT_ERROR, f"listener fd {fd} unusable: {describe_exception(e)}"

        try:
            app = load_app(spec.app, spec.app_dir)
            if spec.preload:
                run_preload(spec.preload)  # no-op in a worker forked from a template that ran it
        except (AppLoadError, PreloadError) as e:
            self.log.error("app_load_failed", app=spec.app or "(demo)", error=str(e),
                           exc_info=e.__cause__ is not None)
            for s in socks:
                s.close()
            return EXIT_APP_LOAD_FAILED, f"app load failed: {e}"
        if spec.gc_freeze:
            gc.freeze()  # import-time objects leave the GC's scans for good
        stack = build_stack(spec, app, self.stats, self.lifespan, self.cache)
        runtime = stack.runtime
        if runtime is not None:
            self.admission = stack.edge
        self.server = WorkerServer(stack.config, on_started=self._on_started)
        if runtime is not None and not spec.tls.enabled:  # TLS: the sentinel cannot answer
            server = self.server
            loop = asyncio.get_running_loop()

            def start_admission_threads() -> None:
                runtime.start_sentinel(socks, lambda sock: loop.call_soon_threadsafe(server.adopt, sock))

            self._sentinel_start = start_admission_threads
        await asyncio.sleep(0)  # let queued control messages (an early Stop) run
        if self._stop_deadline is not None:
            for s in socks:
                s.close()
            return EXIT_OK, self._stop_reason or "stopped"
        self._start_stats()
        try:
            await self.server.serve(sockets=socks)
        except SystemExit as e:  # uvicorn's sys.exit(STARTUP_FAILURE) on lifespan failure
            if e.code == EXIT_APP_LOAD_FAILED:
                why = failure_line(self.lifespan.startup_failed_message or self.lifespan.exception
                                   or "") or "see worker log"
                self.log.error("lifespan_startup_failed", error=why)
                return EXIT_APP_LOAD_FAILED, f"lifespan startup failed: {why}"
            raise RuntimeError(f"uvicorn exited with status {e.code}") from None
        if self.orphaned:
            return EXIT_ERROR, "supervisor gone"
        if self._stop_reason is None:
            return EXIT_ERROR, "server exited without a stop request"
        return EXIT_OK, self._stop_reason


# --- logging -----------------------------------------------------------------------


def _fallback_logging(level: str, fmt: str) -> Any:
    """JSON (or console) lines on stderr for structlog and stdlib (uvicorn) alike."""
    pre = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    final: list[Any] = (
        [structlog.processors.ExceptionRenderer(  # structured traceback, no locals (secrets)
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)),
         structlog.processors.JSONRenderer(default=str)]
        if fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
        else [structlog.dev.ConsoleRenderer(colors=False)]
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=pre,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final]))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    structlog.configure(
        processors=[*pre, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    return structlog.get_logger("numaserve.worker")


def _setup_logging(spec: WorkerSpec) -> Any:
    """Use numaserve.log when it is there; otherwise an equivalent local setup."""
    log: Any = None
    try:
        from numaserve.log import configure_logging, get_logger  # type: ignore[attr-defined]

        configure_logging(spec.log_level, spec.log_format, stream=sys.stderr,
                          process=f"worker-{spec.slot}")
        log = get_logger("numaserve.worker")
    except Exception:  # noqa: BLE001 - missing or incompatible: fall back, never fail to start
        log = None
    if log is None:
        log = _fallback_logging(spec.log_level, spec.log_format)
    ctx = {"slot": spec.slot, "node": spec.node, "generation": spec.generation, "pid": os.getpid()}
    structlog.contextvars.bind_contextvars(**ctx)  # reaches uvicorn's stdlib records too
    return log.bind(**ctx)


def main(argv: list[str] | None = None) -> int:
    """Run the worker described by ``NUMASERVE_WORKER_SPEC``; return the exit status."""
    del argv
    token = take_token()  # first: the pipe is closed and the variable gone before any app code runs
    try:
        spec = spec_from_env()
    except Exception as e:  # noqa: BLE001 - no endpoint to say Goodbye to: stderr only
        sys.stderr.write(json.dumps({"event": "bad_worker_spec", "level": "error",
                                     "error": describe_exception(e)}) + "\n")
        return EXIT_ERROR
    return run_worker(spec, token)


def run_worker(spec: WorkerSpec, token: str) -> int:
    """Serve ``spec`` in this process until stopped; the exit status.

    The body of ``main`` after the spec and token are in hand; a worker forked
    from a warm template (``numaserve.worker.template``) enters here.
    """
    log = _setup_logging(spec)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor orchestrates; Ctrl-C hits it
    try:
        factory = loop_factory(spec.loop)
    except (ValueError, ImportError) as e:
        log.warning("loop_unavailable", loop=spec.loop, error=describe_exception(e))
        factory = None
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(Worker(spec, log, token).run())
    except BaseException:  # noqa: BLE001 - last resort: structured, then status 1
        log.exception("worker_crashed")
        return EXIT_ERROR
