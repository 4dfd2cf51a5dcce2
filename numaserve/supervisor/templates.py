"""Per-node warm templates, supervisor side: start, fork through, replace, respawn.

With ``[worker] start = "fork"`` every node that has slots gets one template
process (``numaserve.worker.template``), started through the exec trampoline
bound to the node (CPUs of its slots, the slots' memory policy), which
imports the app and runs the preload hook once.  A worker spawn then asks
the node's template to fork (a few milliseconds, pages shared
copy-on-write) instead of exec'ing a fresh interpreter.

Whenever forking is not possible the spawn execs as before, with one log
line saying why: no template yet (starting, crashed, backing off), the
template has threads (fork-unsafe), the slot needs a different memory
policy or import-time environment than its template has, the template did
not answer.  Availability first: a fork path problem never stops a slot.

The supervisor is a child subreaper, so forked workers reparent to it and it
reaps them (``numaserve.supervisor.workerproc``).  A template crash is
respawned with the slots' backoff policy; its workers are not its children
and keep serving.  A reload starts a new template generation per node and
switches only when every one is ready (make-before-break); one that fails to
import leaves the old templates in place and fails the reload with its reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from numaserve.bind.launch import build_launch_argv
from numaserve.bind.placement import SlotPlan
from numaserve.workerenv import GPU_VENDORS, THREAD_POOL_VARS
from numaserve.config import Config
from numaserve.net.listeners import Listener
from numaserve.progress import PROGRESS_ENV, read_progress
from numaserve.supervisor.backoff import RestartPolicy, RestartState
from numaserve.supervisor.exits import EXTERNAL_SIGNALS
from numaserve.supervisor.fdbudget import restore_child_nofile
from numaserve.supervisor.lifecycle import LOADING_LOG_S, describe_exit
from numaserve.supervisor.loadwatch import LoadProgress, load_verdict, read_sample
from numaserve.supervisor.notify import Notifier
from numaserve.supervisor.operations import Operation
from numaserve.supervisor.slots import SlotState
from numaserve.topology.model import Gpu
from numaserve.control.workerauth import TOKEN_FD_ENV
from numaserve.supervisor.workerproc import (
    ForkedProcess,
    reap_strays,
    set_child_subreaper,
)
from numaserve.worker.spec import SPEC_ENV, WorkerSpec
from numaserve.worker.template import (
    BOOT_IDLE_S,
    TEMPLATE_SPEC_ENV,
    TemplateSpec,
    recv_msg,
    send_msg,
)
from numaserve.worker.zygote import ZYGOTE_SPEC_ENV, ZygoteSpec

__all__ = ["FORK_REPLY_TIMEOUT_S", "TemplateManager", "TemplateProc", "import_time_mismatch", "read_smaps_rollup"]

log = structlog.get_logger("numaserve.supervisor")

#: A fork takes milliseconds; a template that does not answer in this long is treated as hung.
FORK_REPLY_TIMEOUT_S = 3.0

#: How often a start-up wait looks at its loading templates (liveness, deadline, STATUS=).
LOAD_POLL_S = 0.5

#: A zygote imports numaserve's worker stack only (about a second): bounded even when
#: supervisor.ready_timeout is 0.
ZYGOTE_READY_S = 60.0

#: Nice steps a template generation (or zygote) imports at while workers serve on its node:
#: the import then takes CPU the serving workers leave, instead of a fair share of theirs.
BOOT_NICE = 10

# Template states.
STARTING = "starting"
READY = "ready"          # forks on request
REFUSED = "refused"      # imported fine, but has threads: forking is unsafe, workers are exec'd
FAILED = "failed"        # the app or preload failed in it (reason says why)
EXITED = "exited"

_GPU_VARS = tuple(v for v, _ in GPU_VENDORS.values()) + ("CUDA_DEVICE_ORDER",)


def import_time_mismatch(template_env: Mapping[str, str], slot_env: Mapping[str, str]) -> list[str]:
    """Variables read when libraries load (allocator, thread pools, GPUs, Python's own)
    whose value differs between a template and a slot: a fork would not honour them."""
    keys = set(template_env) | set(slot_env)

    def matters(k: str) -> bool:
        return (k in THREAD_POOL_VARS or k in _GPU_VARS or k.startswith(("LD_", "MALLOC", "PYTHON"))) \
            and k not in (SPEC_ENV, TEMPLATE_SPEC_ENV, ZYGOTE_SPEC_ENV, TOKEN_FD_ENV)

    return sorted(k for k in keys if matters(k) and template_env.get(k) != slot_env.get(k))


def read_smaps_rollup(pid: int, proc: str = "/proc") -> dict[str, int] | None:
    """rss/pss/shared/private bytes of a process (``/proc/PID/smaps_rollup``), None if unreadable."""
    try:
        with open(f"{proc}/{pid}/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return None
    kb: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
            kb[parts[0][:-1]] = int(parts[1])
    return {
        "rss_bytes": kb.get("Rss", 0) * 1024,
        "pss_bytes": kb.get("Pss", 0) * 1024,
        "shared_bytes": (kb.get("Shared_Clean", 0) + kb.get("Shared_Dirty", 0)) * 1024,
        "private_bytes": (kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)) * 1024,
    }


@dataclass
class TemplateProc:
    """One generation of one node's template."""

    node: int
    generation: int
    popen: subprocess.Popen[bytes]
    sock: socket.socket
    env: dict[str, str]
    mempolicy: str
    memory_nodes: tuple[int, ...]
    cpus: tuple[int, ...]
    started: float
    state: str = STARTING
    ready_at: float | None = None
    import_s: float | None = None
    preload_s: float | None = None
    threads: list[str] = field(default_factory=list)
    reason: str | None = None
    forks: int = 0
    exit_code: int | None = None
    retired: bool = False
    ready_evt: asyncio.Event = field(default_factory=asyncio.Event)
    kind: str = "template"                 # or "zygote" (forks templates, never imports the app)
    cwd: str = ""
    forked_from: int | None = None         # the zygote's pid, when a zygote forked this template
    progress_path: str | None = None       # its numaserve.progress file while it loads
    load: LoadProgress | None = None       # signs of life until ready (supervisor.loadwatch)
    killed_for: str | None = None          # set when the supervisor killed it (stalled, deadline)

    @property
    def pid(self) -> int:
        return self.popen.pid


@dataclass
class NodeTemplate:
    """A node's template slot: the current generation and its restart bookkeeping."""

    node: int
    plans: list[SlotPlan]
    restart: RestartState
    current: TemplateProc | None = None
    generation: int = 0
    next_start: float | None = None
    restarts: int = 0
    last_exit: str | None = None
    fallback_logged: str | None = None
    zygote: TemplateProc | None = None
    zygote_restart: RestartState | None = None
    zygote_next: float | None = None
    zygote_starts: int = 0
    zygote_last_exit: str | None = None


class TemplateHost(Protocol):
    """What the templates read of the slots: the live config (a reload replaces it), whether a
    node's workers serve, whether the supervisor stops, and the loop's wake-up (the slot table)."""

    @property
    def cfg(self) -> Config: ...

    @property
    def slots(self) -> Mapping[int, SlotState]: ...

    @property
    def stopping(self) -> bool: ...

    @property
    def wake(self) -> asyncio.Event: ...


class TemplateManager:
    """Owns every node's template; the arbiter calls ``start``, ``forker``, ``tick``, ``reload``, ``close``.

    ``gpus``: the topology's GPUs now (a reload may re-read them); ``notifier``: systemd STATUS=
    while templates load; ``progress_file``: a loading template's progress file path (none: not read).
    """

    def __init__(self, host: TemplateHost, plans: Sequence[SlotPlan], *, policy: RestartPolicy | None = None,
                 gpus: Callable[[], Sequence[Gpu]] = tuple, notifier: Notifier | None = None,
                 progress_file: Callable[[str], str] | None = None) -> None:
        self.host = host
        self.plans = tuple(plans)
        self.gpus = gpus
        self.notifier = notifier
        self.make_progress_file = progress_file
        self.nodes: dict[int, NodeTemplate] = {}
        self.retired: list[TemplateProc] = []
        self.subreaper = False
        self.disabled_reason: str | None = None
        self.policy = policy or RestartPolicy()

    # ------------------------------------------------------------ configuration

    def wanted(self, cfg: Config | None = None) -> bool:
        cfg = cfg or self.host.cfg
        return cfg.worker.start == "fork" and not cfg.server.cmd

    @property
    def enabled(self) -> bool:
        return bool(self.nodes)

    def _group(self) -> dict[int, list[SlotPlan]]:
        out: dict[int, list[SlotPlan]] = {}
        for p in self.plans:
            out.setdefault(p.node, []).append(p)
        return out

    # ------------------------------------------------------------------- start

    async def start(self) -> None:
        """Start every node's template and wait (bounded) until each is ready or failed."""
        if not self.wanted():
            return
        if not self.subreaper:
            try:
                set_child_subreaper(True)
                self.subreaper = True
            except OSError as e:
                self.disabled_reason = f"cannot become a child subreaper ({e}): workers are exec'd"
                log.error("templates_disabled", reason=self.disabled_reason)
                return
        for node, plans in sorted(self._group().items()):
            self.nodes[node] = NodeTemplate(node=node, plans=plans, restart=RestartState(self.policy),
                                            zygote_restart=RestartState(self.policy))
        zygotes = [z for nt in self.nodes.values() if (z := self._start_zygote(nt, self.host.cfg)) is not None]
        await self._wait_ready(zygotes, self.host.cfg)
        started = []
        for nt in self.nodes.values():
            t = self._start_generation(nt, self.host.cfg)
            if t is not None:
                nt.current = t
                started.append(t)
        await self._wait_ready(started, self.host.cfg)
        for t in started:
            nt = self.nodes[t.node]
            if t.state == STARTING:
                code = t.popen.poll()
                self._retire(t, t.killed_for or (describe_exit(code) + " before it was ready" if code is not None
                                                 else "not ready when the supervisor stopped waiting"))
                nt.current = None
                nt.last_exit = t.reason
                self._schedule_restart(nt, time.monotonic(), t.reason or "not ready",
                                       external=self._external_exit(t, code))
            elif t.state == FAILED:
                log.error("template_failed", node=t.node, generation=t.generation, reason=t.reason,
                          fallback="exec")

    def _node_env(self, nt: NodeTemplate, cfg: Config) -> tuple[dict[str, str], tuple[int, ...], SlotPlan]:
        """The environment, CPUs and first plan a node's template (and zygote) starts with."""
        from numaserve.supervisor.spawn import numaserve_env, worker_env

        first = nt.plans[0]
        cpus = tuple(sorted({c for p in nt.plans for c in p.cpus}))
        base = os.environ
        gpus = self.gpus()
        extra = numaserve_env(cfg, base, first, 0, gpus)
        env = worker_env(base, None, extra)
        for k in ("NUMASERVE_SLOT", "NUMASERVE_GENERATION", TOKEN_FD_ENV):
            env.pop(k, None)
        return env, cpus, first

    def _serving(self, nt: NodeTemplate) -> bool:
        """Whether workers serve on this node now (a boot then runs at a lower priority)."""
        return any(sl.worker is not None for sl in self.host.slots.values() if sl.plan.node == nt.node)

    def _spawn(self, nt: NodeTemplate, cfg: Config, kind: str, module: str, spec_var: str, spec_json: Any,
               child: socket.socket, env: dict[str, str], cpus: tuple[int, ...], first: SlotPlan,
               generation: int) -> TemplateProc | None:
        """Exec a template or zygote through the trampoline, bound to the node."""
        launch_env = dict(env)
        launch_env[spec_var] = spec_json(child.fileno())
        # the words after the module are for ps(1) only (forked workers show them too)
        shown = [f"node={nt.node}"] + ([] if kind == "zygote" else [f"app={cfg.server.app or 'numaserve.apps.demo:app'}"])
        argv = build_launch_argv([sys.executable, "-m", module, *shown], cpus=cpus or None,
                                 mempolicy=first.mempolicy, nodes=first.memory_nodes, ppid=os.getpid())
        try:
            popen = subprocess.Popen(argv, pass_fds=[child.fileno()], env=launch_env, stdin=subprocess.DEVNULL,
                                     close_fds=True, process_group=0, cwd=cfg.server.app_dir or None)
        except OSError as e:
            log.error(f"{kind}_spawn_failed", node=nt.node, error=str(e))
            return None
        restore_child_nofile(popen.pid)
        return self._proc(nt, kind, popen, env, cpus, first, generation, cfg)

    def _proc(self, nt: NodeTemplate, kind: str, popen: Any, env: dict[str, str], cpus: tuple[int, ...],
              first: SlotPlan, generation: int, cfg: Config, sock: socket.socket | None = None,
              forked_from: int | None = None) -> TemplateProc:
        t = TemplateProc(node=nt.node, generation=generation, popen=popen, sock=sock, env=env,  # type: ignore[arg-type]
                         mempolicy=first.mempolicy, memory_nodes=tuple(first.memory_nodes), cpus=cpus,
                         started=time.monotonic(), kind=kind, cwd=_cwd(cfg),
                         forked_from=forked_from)
        return t

    def _watch(self, t: TemplateProc, sock: socket.socket) -> None:
        sock.setblocking(False)
        t.sock = sock
        try:
            asyncio.get_running_loop().add_reader(sock.fileno(), self._on_readable, t)
        except RuntimeError:
            pass  # no loop (unit tests drive _drain by hand)

    def _start_zygote(self, nt: NodeTemplate, cfg: Config) -> TemplateProc | None:
        """Exec the node's zygote (numaserve's worker stack imported, not the app)."""
        env, cpus, first = self._node_env(nt, cfg)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        nice = BOOT_NICE if self._serving(nt) else 0
        try:
            z = self._spawn(nt, cfg, "zygote", "numaserve.worker.zygote", ZYGOTE_SPEC_ENV,
                            lambda fd: ZygoteSpec(node=nt.node, control_fd=fd, log_level=cfg.log.level,
                                                  log_format=cfg.log.format, gc_freeze=cfg.allocator.gc_freeze,
                                                  boot_nice=nice).to_env(),
                            child, env, cpus, first, 0)
        finally:
            child.close()
        if z is None:
            parent.close()
            self._schedule_zygote(nt, time.monotonic(), "spawn failed")
            return None
        self._watch(z, parent)
        nt.zygote = z
        nt.zygote_starts += 1
        log.info("zygote_spawn", node=nt.node, pid=z.pid, cpus=list(cpus), mempolicy=first.mempolicy)
        return z

    def zygote_mismatch(self, z: TemplateProc, env: Mapping[str, str], cpus: tuple[int, ...], first: SlotPlan,
                        cwd: str) -> str | None:
        """Why a template generation cannot be forked from zygote ``z`` (None: it can)."""
        if z.state != READY:
            return f"zygote is {z.state}"
        if (z.cpus, z.mempolicy, z.memory_nodes) != (cpus, first.mempolicy, tuple(first.memory_nodes)):
            return "CPUs or memory policy changed"
        if z.cwd != cwd:
            return "server.app_dir changed"
        bad = import_time_mismatch(z.env, env)
        return f"import-time variables changed ({', '.join(bad)})" if bad else None

    def _start_generation(self, nt: NodeTemplate, cfg: Config) -> TemplateProc | None:
        """Spawn a new template generation for ``nt`` (not made current: the caller decides).

        Forked from the node's zygote when it is ready and matches (a reload then pays the
        app's import only); exec'd otherwise, and a mismatched zygote is replaced for next time.
        """
        env, cpus, first = self._node_env(nt, cfg)
        nt.generation += 1
        progress = self._progress_file(f"template-node{nt.node}-gen{nt.generation}")
        if progress:
            env[PROGRESS_ENV] = progress
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        nice = BOOT_NICE if self._serving(nt) else 0

        def spec_json(fd: int) -> str:
            return TemplateSpec(
                node=nt.node, generation=nt.generation, app=cfg.server.app, app_dir=cfg.server.app_dir,
                preload=cfg.worker.preload, control_fd=fd, log_level=cfg.log.level,
                log_format=cfg.log.format, gc_freeze=cfg.allocator.gc_freeze, boot_nice=nice,
            ).to_env()

        t: TemplateProc | None = None
        z = nt.zygote
        why = "no zygote" + (f" ({nt.zygote_last_exit})" if nt.zygote_last_exit else "") if z is None else \
            self.zygote_mismatch(z, env, cpus, first, _cwd(cfg))
        try:
            if z is not None and why is None:
                t, why = self._fork_template(nt, z, cfg, json.loads(spec_json(-1)), env, cpus, first, child)
            if t is None:
                t = self._spawn(nt, cfg, "template", "numaserve.worker.template", TEMPLATE_SPEC_ENV, spec_json,
                                child, env, cpus, first, nt.generation)
        finally:
            child.close()
        if why is not None:
            log.info("template_exec", node=nt.node, generation=nt.generation, reason=f"not forked from a zygote: {why}")
        if z is not None and why is not None and z.state == READY:
            self._retire(z, f"replaced: {why}")
            nt.zygote = None
        if nt.zygote is None and nt.zygote_next is None and not self.host.stopping:
            self._start_zygote(nt, cfg)  # ready for the next generation; not waited for
        if t is None:
            parent.close()
            self._schedule_restart(nt, time.monotonic(), "spawn failed")
            return None
        t.progress_path = env.get(PROGRESS_ENV)
        t.load = LoadProgress.begin(t.started)
        self._watch(t, parent)
        if nice:
            self._bound_boot_idle(t)
        log.info("template_spawn", node=nt.node, generation=t.generation, pid=t.pid, cpus=list(cpus),
                 mempolicy=first.mempolicy, memory_nodes=list(first.memory_nodes),
                 app=cfg.server.app or "numaserve.apps.demo:app", preload=cfg.worker.preload or None,
                 forked_from=t.forked_from)
        return t

    def _bound_boot_idle(self, t: TemplateProc) -> None:
        """End a booting template's SCHED_IDLE phase from outside after ``BOOT_IDLE_S`` (and again later).

        The template arms its own timer, but a SCHED_IDLE process on CPUs with no idle time
        barely runs, so its own SIGALRM handler may run late; the supervisor is not starved.
        It only leaves SCHED_IDLE (nice +10 stays until the template restores its priority).
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        for delay in (BOOT_IDLE_S, 2 * BOOT_IDLE_S):  # the second covers a fork that took longer
            loop.call_later(delay, self._end_boot_idle, t)

    @staticmethod
    def _end_boot_idle(t: TemplateProc) -> None:
        if t.state != STARTING or not hasattr(os, "SCHED_IDLE"):
            return
        try:
            if os.sched_getscheduler(t.pid) == os.SCHED_IDLE:
                os.sched_setscheduler(t.pid, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            pass  # gone, or not ours to change: its own timer still ends the phase

    def _fork_template(self, nt: NodeTemplate, z: TemplateProc, cfg: Config, spec: dict[str, Any],
                       env: dict[str, str], cpus: tuple[int, ...], first: SlotPlan,
                       child: socket.socket) -> tuple[TemplateProc | None, str | None]:
        req = {"t": "template", "id": uuid.uuid4().hex[:12], "spec": spec, "env": env,
               "cwd": _cwd(cfg), "reaper": os.getpid()}
        msg, why = self._ask(z, req, [child.fileno()])
        if msg is None:
            return None, why
        if msg.get("t") == "forked":
            pid = int(msg["pid"])
            z.forks += 1
            restore_child_nofile(pid)
            proc = ForkedProcess(pid, template_pid=z.pid, node=nt.node)
            return self._proc(nt, "template", proc, env, cpus, first, nt.generation, cfg, forked_from=z.pid), None
        if msg.get("t") == "refused":
            z.state = REFUSED
            z.threads = [str(x) for x in msg.get("threads") or []][:32]
            z.reason = str(msg.get("reason"))[:500]
            log.error("zygote_refused", node=nt.node, pid=z.pid, threads=z.threads, reason=z.reason)
            return None, z.reason
        return None, f"zygote: {msg.get('reason') or msg.get('t')}"

    async def _wait_ready(self, ts: Sequence[TemplateProc], cfg: Config) -> None:
        """Until each is ready, failed or gone, or the supervisor stops.

        Templates are judged as the watchdog judges loading workers (``judge``): one that
        stalls, or passes an operator's ``supervisor.ready_timeout``, is killed with the
        reason.  Each pass's waits are cancelled and awaited: none is left pending.
        """
        while True:
            pending = [t for t in ts if t.state == STARTING and t.popen.poll() is None]
            if not pending or self.host.stopping:
                return
            now = time.monotonic()
            for t in pending:
                if t.killed_for is None:
                    self.judge(t, now, cfg)
            self._notify_loading(now)
            waits = [asyncio.ensure_future(t.ready_evt.wait()) for t in pending]
            try:
                await asyncio.wait(waits, timeout=LOAD_POLL_S)
            finally:
                for w in waits:
                    w.cancel()
                await asyncio.gather(*waits, return_exceptions=True)

    def judge(self, t: TemplateProc, now: float, cfg: Config) -> None:
        """A starting template's signs of life (progress file, /proc); kill it when stalled or late."""
        sup = cfg.supervisor
        if t.kind == "zygote":
            limit = sup.ready_timeout or ZYGOTE_READY_S
            why = f"not ready within {limit:g}s" if now - t.started > limit else None
        else:
            if t.load is None:
                t.load = LoadProgress.begin(t.started)
            p = t.load
            data = read_progress(t.progress_path) if t.progress_path else None
            if data is not None:
                p.heard(now, data["beat"], "load beat")
                p.report(now, data["at"], data["fraction"], data["note"])
            p.observe(now, read_sample(t.pid))
            if p.log_due(now, LOADING_LOG_S):
                log.info("template_loading", node=t.node, generation=t.generation, pid=t.pid,
                         elapsed_s=round(now - p.started, 1), rss_bytes=p.sample.rss_bytes if p.sample else None,
                         fraction=p.fraction, note=p.note or None, last_sign=p.sign,
                         last_sign_s=round(now - p.last_sign, 1))
            why = load_verdict(p, now, stall_after=sup.heartbeat_timeout, deadline=sup.ready_timeout)
        if why is not None:
            t.killed_for = t.reason = why
            log.error(f"{t.kind}_killed", node=t.node, generation=t.generation, pid=t.pid, reason=why)
            self._kill(t)

    def loading(self, node: int, now: float | None = None) -> dict[str, Any] | None:
        """The node's current template load, for the slots waiting on it (None when not loading)."""
        nt = self.nodes.get(node)
        t = nt.current if nt else None
        if t is None or t.state != STARTING or t.load is None or t.popen.poll() is not None:
            return None
        return {**t.load.to_json(time.monotonic() if now is None else now), "by": "template", "pid": t.pid}

    def _notify_loading(self, now: float) -> None:
        """systemd STATUS= while templates load (the supervision loop does not tick yet)."""
        notifier = self.notifier
        if notifier is None or not notifier.enabled:
            return
        parts = [f"node{nt.node} template {nt.current.load.describe(now)}" for nt in self.nodes.values()
                 if nt.current is not None and nt.current.state == STARTING and nt.current.load is not None]
        if parts:
            notifier.status("starting: " + "; ".join(parts))
            notifier.extend_start(now)

    def _progress_file(self, name: str) -> str | None:
        make = self.make_progress_file
        if make is None:
            return None
        try:
            return str(make(name))
        except OSError as e:
            log.warning("progress_file_unusable", name=name, error=str(e))
            return None

    @staticmethod
    def _external_exit(t: TemplateProc, code: int | None) -> bool:
        """Killed by a signal from outside (OOM killer, operator), not by us and not by its own failure."""
        if code is None or code >= 0 or t.killed_for is not None or t.state == FAILED:
            return False
        try:
            return signal.Signals(-code) in EXTERNAL_SIGNALS
        except ValueError:
            return False

    # ---------------------------------------------------------------- messages

    def _on_readable(self, t: TemplateProc) -> None:
        self._drain(t)
        self.host.wake.set()

    def _drain(self, t: TemplateProc) -> None:
        """Read what a template said on its own (ready / failed); end-of-file means it is going."""
        while True:
            try:
                msg, fds = recv_msg(t.sock)
            except (BlockingIOError, InterruptedError):
                return
            except (OSError, ValueError) as e:
                log.warning("template_bad_message", node=t.node, generation=t.generation, error=str(e))
                if isinstance(e, OSError):
                    self._unwatch(t)
                    return
                continue
            for fd in fds:
                os.close(fd)
            if msg is None:
                self._unwatch(t)
                t.ready_evt.set()
                return
            kind = msg.get("t")
            if kind == "ready" and t.state == STARTING:
                t.ready_at = time.monotonic()
                t.import_s = _num(msg.get("import_s"))
                t.preload_s = _num(msg.get("preload_s"))
                t.threads = [str(x) for x in msg.get("threads") or []][:32]
                if t.threads:
                    t.state = REFUSED
                    t.reason = f"the {t.kind} has threads, forking it is unsafe: " + "; ".join(t.threads)
                    log.error("fork_refused" if t.kind == "template" else "zygote_refused", node=t.node, generation=t.generation, pid=t.pid, threads=t.threads,
                              fallback="exec", reason=t.reason)
                    self._stop_refused(t)
                    t.ready_evt.set()
                    return               # its channel is closed: nothing more to read
                t.state = READY
                t.ready_evt.set()
            elif kind == "failed" and t.state == STARTING:
                t.state = FAILED
                t.reason = str(msg.get("reason") or "failed")[:500]
                t.ready_evt.set()
            else:
                log.debug("template_unexpected_message", node=t.node, kind=kind)

    def _unwatch(self, t: TemplateProc) -> None:
        try:
            asyncio.get_running_loop().remove_reader(t.sock.fileno())
        except (RuntimeError, ValueError, OSError):
            pass

    # -------------------------------------------------------------------- fork

    def forker(self) -> Callable[..., ForkedProcess | None] | None:
        """The fork hook for ``spawn`` (None when templates are off)."""
        return self.fork if self.enabled else None

    def fork(self, plan: SlotPlan, spec: WorkerSpec, env: Mapping[str, str], listeners: Sequence[Listener],
             token: str | None) -> ForkedProcess | None:
        """Fork the slot's worker from its node's template; None (reason logged) to exec instead."""
        nt = self.nodes.get(plan.node)
        t = nt.current if nt else None
        why = None
        if t is None or token is None:
            why = f"no template for node {plan.node}" + (f" ({nt.last_exit})" if nt and nt.last_exit else "")
        elif t.state != READY:
            why = f"node {plan.node} template is {t.state}" + (f": {t.reason}" if t.reason else "")
        elif (plan.mempolicy, tuple(plan.memory_nodes)) != (t.mempolicy, t.memory_nodes):
            why = f"slot {plan.slot} memory policy differs from its node template's"
        else:
            bad = import_time_mismatch(t.env, env)
            if bad:
                why = f"slot {plan.slot} needs other import-time variables than its template ({', '.join(bad)})"
        if why is None:
            assert t is not None and token is not None
            proc, why = self._request_fork(t, plan, spec, env, listeners, token)
            if proc is not None:
                if nt is not None:
                    nt.fallback_logged = None  # a later fallback is news again
                return proc
        assert nt is not None or why
        key = why or ""
        if nt is None or nt.fallback_logged != key:
            log.warning("spawn_exec_fallback", slot=plan.slot, node=plan.node, reason=why)
            if nt is not None:
                nt.fallback_logged = key
        return None

    def _ask(self, t: TemplateProc, req: dict[str, Any], send_fds: Sequence[int]) -> tuple[dict[str, Any] | None, str]:
        """One request to a template or zygote and its answer (blocking, bounded); (None, why) on failure."""
        rid = req["id"]
        self._unwatch(t)
        t.sock.settimeout(FORK_REPLY_TIMEOUT_S)
        try:
            send_msg(t.sock, req, send_fds)
            deadline = time.monotonic() + FORK_REPLY_TIMEOUT_S
            while True:
                msg, fds = recv_msg(t.sock)
                for fd in fds:
                    os.close(fd)
                if msg is None:
                    return None, f"node {t.node} {t.kind} closed its channel"
                if msg.get("id") == rid:
                    return msg, ""
                if time.monotonic() > deadline:
                    raise TimeoutError
        except TimeoutError:
            t.reason = f"did not answer a {req['t']} request within {FORK_REPLY_TIMEOUT_S:g}s"
            log.error(f"{t.kind}_hung", node=t.node, generation=t.generation, pid=t.pid, reason=t.reason)
            self._kill(t)
            return None, f"node {t.node} {t.kind} {t.reason}"
        except (OSError, ValueError) as e:
            return None, f"node {t.node} {t.kind} channel failed: {e}"
        finally:
            if t.sock.fileno() >= 0:
                t.sock.setblocking(False)
                if t.popen.poll() is None:
                    try:
                        asyncio.get_running_loop().add_reader(t.sock.fileno(), self._on_readable, t)
                    except RuntimeError:
                        pass

    def _request_fork(self, t: TemplateProc, plan: SlotPlan, spec: WorkerSpec, env: Mapping[str, str],
                      listeners: Sequence[Listener], token: str) -> tuple[ForkedProcess | None, str | None]:
        import msgspec

        rid = uuid.uuid4().hex[:12]
        req = {"t": "fork", "id": rid, "spec": msgspec.to_builtins(spec), "token": token, "env": dict(env),
               "cpus": list(plan.cpus), "reaper": os.getpid()}
        msg, why = self._ask(t, req, [lst.fd for lst in listeners])
        if msg is None:
            return None, why
        kind = msg.get("t")
        if kind == "forked":
            pid = int(msg["pid"])
            t.forks += 1
            restore_child_nofile(pid)
            return ForkedProcess(pid, template_pid=t.pid, template_generation=t.generation, node=t.node), None
        if kind == "refused":
            t.state = REFUSED
            t.threads = [str(x) for x in msg.get("threads") or []][:32]
            t.reason = str(msg.get("reason"))[:500]
            log.error("fork_refused", node=t.node, generation=t.generation, pid=t.pid, threads=t.threads,
                      fallback="exec", reason=t.reason)
            self._stop_refused(t)
            return None, t.reason
        return None, f"node {plan.node} template: {msg.get('reason') or kind}"

    # -------------------------------------------------------------------- tick

    def tick(self, now: float, known_pids: Sequence[int] = ()) -> None:
        """Reap templates (and stray children), respawn crashed ones when their backoff is due.

        A fault here is logged, never raised: workers are exec'd while templates are broken,
        and the supervision loop must go on."""
        if not self.nodes:
            return
        try:
            self._tick(now, known_pids)
        except Exception:
            log.exception("templates_tick_failed")

    def _tick(self, now: float, known_pids: Sequence[int]) -> None:
        for t in list(self.retired):
            if t.popen.poll() is not None:
                self.retired.remove(t)
                self._close_sock(t)
        for nt in self.nodes.values():
            self._tick_zygote(nt, now)
            t = nt.current
            if t is not None and t.state == REFUSED:
                t.popen.poll()  # stopped on purpose (see _stop_refused): reaped, not respawned
                continue
            if t is not None and t.popen.poll() is not None:
                self._drain(t)
                code = t.popen.returncode
                t.exit_code = code
                why = t.reason if t.state == FAILED else (t.killed_for or describe_exit(code))
                nt.current = None
                nt.last_exit = why
                self._close_sock(t)
                if t.progress_path:
                    try:
                        os.unlink(t.progress_path)
                    except OSError:
                        pass
                if not self.host.stopping:
                    log.warning("template_exit", node=nt.node, generation=t.generation, pid=t.pid, exit=why,
                                forks=t.forks, note="its workers keep serving; new workers are exec'd until it is back")
                    self._schedule_restart(nt, now, why, uptime=now - t.started,
                                           external=self._external_exit(t, code))
            elif t is not None and t.state == STARTING and t.killed_for is None:
                self.judge(t, now, self.host.cfg)
            elif t is None and nt.next_start is not None and now >= nt.next_start and not self.host.stopping:
                nt.next_start = None
                new = self._start_generation(nt, self.host.cfg)
                if new is not None:
                    nt.current = new
                    nt.restarts += 1
            elif t is not None and t.state == READY and t.ready_at and now - t.ready_at > self.policy.reset_after:
                nt.restart.consecutive = 0
        if self.subreaper:
            workers = {w.pid for sl in self.host.slots.values() for w in sl.workers()}
            known = set(known_pids) | workers | {nt.current.pid for nt in self.nodes.values() if nt.current} | \
                {nt.zygote.pid for nt in self.nodes.values() if nt.zygote} | {t.pid for t in self.retired}
            for pid, code in reap_strays(known):
                log.info("reaped_stray_child", pid=pid, exit=code)

    def _tick_zygote(self, nt: NodeTemplate, now: float) -> None:
        z = nt.zygote
        if z is not None and z.popen.poll() is not None:
            self._drain(z)
            why = describe_exit(z.popen.returncode) if z.state != REFUSED else (z.reason or "refused")
            nt.zygote = None
            nt.zygote_last_exit = why
            self._close_sock(z)
            if not self.host.stopping:
                log.warning("zygote_exit", node=nt.node, pid=z.pid, exit=why,
                            note="templates keep serving; the next generation is exec'd until it is back")
                if z.state != REFUSED:
                    self._schedule_zygote(nt, now, why, uptime=now - z.started)
        elif z is None and nt.zygote_next is not None and now >= nt.zygote_next and not self.host.stopping:
            nt.zygote_next = None
            self._start_zygote(nt, self.host.cfg)
        elif z is not None and z.state == READY and z.ready_at and now - z.ready_at > self.policy.reset_after \
                and nt.zygote_restart is not None:
            nt.zygote_restart.consecutive = 0

    def _schedule_zygote(self, nt: NodeTemplate, now: float, why: str, uptime: float = 0.0) -> None:
        if nt.zygote_restart is None:
            nt.zygote_restart = RestartState(self.policy)
        delay, looping = nt.zygote_restart.record_exit(now, uptime)
        if looping:
            delay = nt.zygote_restart.retry_delay()
        nt.zygote_next = now + delay
        log.info("zygote_backoff", node=nt.node, delay_s=round(delay, 3), reason=why, crash_loop=looping)

    def _schedule_restart(self, nt: NodeTemplate, now: float, why: str, uptime: float = 0.0,
                          external: bool = False) -> None:
        delay, looping = nt.restart.record_exit(now, uptime, external=external)
        if looping:
            delay = nt.restart.retry_delay()
        nt.next_start = now + delay
        log.info("template_backoff", node=nt.node, delay_s=round(delay, 3), reason=why, crash_loop=looping)

    # ------------------------------------------------------------------ reload

    async def reload(self, cfg: Config, op: Operation | None = None) -> str | None:
        """New template generation on every node, switched in only when all are ready.

        Returns None on success, else why (old templates kept, nothing switched).
        """
        if not self.wanted(cfg):
            for nt in self.nodes.values():
                for t in (nt.current, nt.zygote):
                    if t is not None:
                        self._retire(t, "templates turned off by reload")
                nt.current = nt.zygote = None
            self.nodes.clear()
            return None
        if not self.nodes:
            await self.start()  # exec -> fork by reload, or the first start found no subreaper
            return None
        new = {node: self._start_generation(nt, cfg) for node, nt in self.nodes.items()}
        started = [t for t in new.values() if t is not None]
        timeout = cfg.supervisor.ready_timeout
        await self._wait_ready(started, cfg)
        bad = []
        for node, t in sorted(new.items()):
            if t is None:
                bad.append(f"node {node}: template could not be spawned")
            elif t.state not in (READY, REFUSED):
                state = t.state if t.popen.poll() is None else f"exited ({t.popen.returncode})"
                bad.append(f"node {node}: new template (generation {t.generation}) "
                           + (t.reason or (f"not ready within {timeout:g}s (supervisor.ready_timeout)"
                                           if t.state == STARTING else state)))
        if bad:
            for t in started:
                self._retire(t, "reload failed")
            return "; ".join(bad) + "; old template kept, old worker kept serving on every slot"
        for node, t in new.items():
            nt = self.nodes[node]
            if nt.current is not None:
                self._retire(nt.current, f"replaced by generation {t.generation if t else '?'}")
            nt.current = t
            nt.next_start = None
            nt.fallback_logged = None
            if op is not None and t is not None:
                op.step(f"node {node}: template generation {t.generation} ready", pid=t.pid,
                        import_s=t.import_s, preload_s=t.preload_s, fork=t.state == READY,
                        started_by="zygote" if t.forked_from else "exec")
        return None

    def _stop_refused(self, t: TemplateProc) -> None:
        """A template that cannot fork only holds memory: stop it, keep its record (status says why).

        It is not respawned (it would refuse again); a reload tries a new generation."""
        self._terminate(t)

    def _retire(self, t: TemplateProc, why: str) -> None:
        """Close its channel (it exits on end-of-file) and make sure it goes."""
        t.retired = True
        t.reason = t.reason or why
        if self._terminate(t):
            self.retired.append(t)

    def _terminate(self, t: TemplateProc) -> bool:
        """Channel closed, SIGTERM sent; True when it was still running (reap it later)."""
        self._close_sock(t)
        if t.popen.poll() is not None:
            return False
        try:
            t.popen.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        return True

    def _kill(self, t: TemplateProc) -> None:
        try:
            t.popen.kill()
        except ProcessLookupError:
            pass

    def _close_sock(self, t: TemplateProc) -> None:
        self._unwatch(t)
        try:
            t.sock.close()
        except OSError:
            pass

    def close(self) -> None:
        ts = [nt.current for nt in self.nodes.values() if nt.current] + \
            [nt.zygote for nt in self.nodes.values() if nt.zygote] + list(self.retired)
        for t in ts:
            self._close_sock(t)
            if t.popen.poll() is None:
                t.popen.send_signal(signal.SIGTERM)
        end = time.monotonic() + 2.0
        for t in ts:
            try:
                t.popen.wait(max(0.01, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                t.popen.kill()
                try:
                    t.popen.wait(2)
                except subprocess.TimeoutExpired:
                    pass
            except ChildProcessError:
                pass
        self.retired.clear()
        for nt in self.nodes.values():
            nt.current = nt.zygote = None

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        cfg = self.host.cfg
        out: dict[str, Any] = {"start": cfg.worker.start, "preload": cfg.worker.preload or None,
                               "active": self.enabled, "disabled_reason": self.disabled_reason,
                               "subreaper": self.subreaper, "nodes": []}
        if cfg.server.cmd and cfg.worker.start == "fork":
            out["disabled_reason"] = "server.cmd: external commands are always exec'd"
        now = time.monotonic()
        for node, nt in sorted(self.nodes.items()):
            t = nt.current
            out["nodes"].append({
                "node": node,
                "state": t.state if t else ("backoff" if nt.next_start else "none"),
                "pid": t.pid if t else None,
                "generation": t.generation if t else None,
                "cpus": list(t.cpus) if t else None,
                "mempolicy": t.mempolicy if t else None,
                "memory_nodes": list(t.memory_nodes) if t else None,
                "import_s": t.import_s if t else None,
                "preload_s": t.preload_s if t else None,
                "uptime_s": round(now - t.started, 3) if t else None,
                "forks": t.forks if t else 0,
                "threads": list(t.threads) if t else [],
                "reason": t.reason if t else None,
                "loading": t.load.to_json(now) if t and t.state == STARTING and t.load else None,
                "memory": read_smaps_rollup(t.pid) if t and t.popen.poll() is None else None,
                "running": bool(t and t.popen.poll() is None),
                "restarts": nt.restarts,
                "last_exit": nt.last_exit,
                "restart_in_s": round(max(0.0, nt.next_start - now), 3) if nt.next_start else None,
                "started_by": ("zygote" if t.forked_from else "exec") if t else None,
                "zygote": self._zygote_status(nt, now),
            })
        return out

    def _zygote_status(self, nt: NodeTemplate, now: float) -> dict[str, Any]:
        z = nt.zygote
        running = bool(z and z.popen.poll() is None)
        return {
            "state": z.state if z else ("backoff" if nt.zygote_next else "none"),
            "pid": z.pid if z else None,
            "import_s": z.import_s if z else None,
            "uptime_s": round(now - z.started, 3) if z else None,
            "templates_forked": z.forks if z else 0,
            "reason": z.reason if z else None,
            "memory": read_smaps_rollup(z.pid) if z and running else None,
            "running": running,
            "starts": nt.zygote_starts,
            "last_exit": nt.zygote_last_exit,
        }

    @staticmethod
    def worker_start(popen: Any) -> dict[str, Any]:
        """How a worker was started: forked from which template, or exec'd."""
        if isinstance(popen, ForkedProcess):
            return {"mode": "fork", "template_pid": popen.template_pid,
                    "template_generation": popen.template_generation, "node": popen.node}
        return {"mode": "exec"}


def _cwd(cfg: Config) -> str:
    """The directory templates run in, absolute (a zygote forks them from its own, maybe other, cwd)."""
    return os.path.abspath(cfg.server.app_dir) if cfg.server.app_dir else ""


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) else None
