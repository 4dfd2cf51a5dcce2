"""Start one worker process, already bound, on its slot's inherited listeners.

The process is started through the exec trampoline (``numaserve.bind.launch``):
CPU affinity and memory policy are in force before the worker's interpreter
starts, so every thread and every page it ever has is placed (FACTS §1.6).
``subprocess.Popen`` execs in C (no Python runs between fork and exec), which
is safe in a supervisor that has threads (ZeroMQ's I/O thread).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from typing import Any, Callable, Iterable, Mapping

from numaserve.bind.allocator import allocator_env
from numaserve.config import AllocatorConfig, CacheConfig, Config, FramingConfig, TlsConfig
from numaserve.cpulist import format_list
from numaserve.errors import UsageError
from numaserve.bind.launch import build_launch_argv
from numaserve.net.listeners import Listener
from numaserve.progress import PROGRESS_ENV
from numaserve.bind.placement import SlotPlan
from numaserve.supervisor.fdbudget import restore_child_nofile
from numaserve.control.workerauth import TOKEN_FD_ENV, token_pipe
from numaserve.supervisor.workerproc import WorkerProcess
from numaserve.worker.spec import SPEC_ENV, WorkerSpec
from numaserve.worker.tls import check_tls
from numaserve.workerenv import slot_env

CMD_PLACEHOLDERS = ("fd", "fds", "host", "port", "node", "slot", "cpus", "generation")


def _section(cfg: Config, name: str, default: type[Any]) -> Any:
    """A serving section of the config (its defaults when the schema lacks it)."""
    return getattr(cfg, name, None) or default()


def _checked_tls(tls: TlsConfig) -> TlsConfig:
    """Cert and key are loaded once here, per spawn: a broken renewal fails the spawn clearly."""
    check_tls(tls)
    return tls


def worker_spec(cfg: Config, plan: SlotPlan, generation: int, listeners: list[Listener], control: str,
                node_cpus: Iterable[int] = ()) -> WorkerSpec:
    s = cfg.server
    return WorkerSpec(
        node_cpus=sorted(node_cpus),
        slot=plan.slot,
        node=plan.node,
        generation=generation,
        cpus=list(plan.cpus),
        mempolicy=plan.mempolicy,
        memory_nodes=list(plan.memory_nodes),
        fd=listeners[0].fd,
        extra_fds=[lst.fd for lst in listeners[1:]],
        control=control,
        server=s,
        preload=cfg.worker.preload,
        heartbeat_interval=cfg.supervisor.heartbeat_interval,
        stats_interval=1.0,
        admission=cfg.admission,
        framing=_section(cfg, "framing", FramingConfig),
        cache=_section(cfg, "cache", CacheConfig),
        tls=_checked_tls(_section(cfg, "tls", TlsConfig)),
        gc_freeze=_section(cfg, "allocator", AllocatorConfig).gc_freeze,
        log_level=cfg.log.level,
        log_format=cfg.log.format,  # "auto" decided by each worker on its stderr (ours: a tty or not)
    )


def render_cmd(template: str, plan: SlotPlan, generation: int, listeners: list[Listener]) -> list[str]:
    """Expand ``{fd} {host} {port} {node} {slot} {cpus}`` in an external command."""
    first = listeners[0]
    values = {
        "fd": str(first.fd),
        "fds": ",".join(str(lst.fd) for lst in listeners),
        "host": first.host,
        "port": str(first.port),
        "node": str(plan.node),
        "slot": str(plan.slot),
        "cpus": format_list(plan.cpus),
        "generation": str(generation),
    }
    try:
        argv = shlex.split(template)
    except ValueError as e:
        raise UsageError(f"server.cmd: cannot split {template!r}: {e}") from None
    out = []
    for arg in argv:
        try:
            out.append(arg.format(**values))
        except KeyError as e:
            raise UsageError(
                f"server.cmd: unknown placeholder {{{e.args[0]}}}: expected one of "
                + " ".join("{" + p + "}" for p in CMD_PLACEHOLDERS)
            ) from None
        except (ValueError, IndexError) as e:
            raise UsageError(f"server.cmd: bad placeholder in {arg!r}: {e}") from None
    if not out:
        raise UsageError("server.cmd: empty command")
    return out


def check_cmd_template(template: str, *, allow_host_port: bool = False) -> None:
    """Validate an external command template before any listener exists.

    ``{host}``/``{port}`` are refused unless ``cmd.allow_host_port``: a server
    told where to listen binds its *own* socket, which joins the port's
    SO_REUSEPORT group beside the supervisor's listeners and takes a share of
    the connections with no steering, no readiness probe and no queue kept
    across its restarts.
    """
    from numaserve.net.listeners import Listener as _L
    from numaserve.cmdready import host_port_placeholders
    import socket

    fake = _L(0, "127.0.0.1", 0, socket.AF_INET, socket.socket())
    try:
        render_cmd(template, SlotPlan(slot=0, node=0, index=0, cpus=(0,), mempolicy="bind", memory_nodes=(0,)), 1, [fake])
    finally:
        fake.sock.close()
    used = host_port_placeholders(template)
    if used and not allow_host_port:
        names = " and ".join("{" + n + "}" for n in used)
        raise UsageError(
            f"server.cmd uses {names}: a server given an address binds its own socket, which joins the port's "
            "SO_REUSEPORT group beside numaserve's listeners and takes a share of the connections without "
            "steering, readiness or queue-keeping. Pass the listener instead with {fd} (uvicorn --fd {fd}, "
            "gunicorn --bind fd://{fd} --no-control-socket, hypercorn --bind fd://{fd}), or set cmd.allow_host_port = true (--allow-host-port) if "
            "the command only uses them as information"
        )


def numaserve_env(cfg: Config, base: Mapping[str, str], plan: SlotPlan, generation: int,
                  all_gpus: Iterable[object] = ()) -> dict[str, str]:
    """What numaserve sets for this slot (shown in status and plan)."""
    env = slot_env(
        slot=plan.slot, node=plan.node, index=plan.index, cpus=plan.cpus, gpus=plan.gpus, all_gpus=all_gpus,
        env_cfg=cfg.env, inherited=base, generation=generation,
    )
    env["NUMASERVE_MEMPOLICY"] = plan.mempolicy + (":" + format_list(plan.memory_nodes) if plan.memory_nodes else "")
    for key, value in allocator_env(_section(cfg, "allocator", AllocatorConfig), base).items():
        env.setdefault(key, value)  # a value from [env] wins
    return env


def worker_env(base: Mapping[str, str], spec: WorkerSpec | None, extra: Mapping[str, str]) -> dict[str, str]:
    """The worker's whole environment: ``base``, then ``extra`` (``numaserve_env``: the slot's
    ``NUMASERVE_*`` identity over the operator's variables), unbuffered output and the spec."""
    env = dict(base)
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    if spec is not None:
        env[SPEC_ENV] = spec.to_env()
    else:
        env.pop(SPEC_ENV, None)
    return env


def spawn(
    cfg: Config,
    plan: SlotPlan,
    generation: int,
    listeners: list[Listener],
    control: str,
    *,
    environ: Mapping[str, str] | None = None,
    all_gpus: Iterable[object] = (),
    node_cpus: Iterable[int] = (),
    token: str | None = None,
    forker: Callable[..., WorkerProcess | None] | None = None,
    progress_file: str = "",
) -> tuple[WorkerProcess, bool, dict[str, str]]:
    """Start the slot's worker; returns (process, external?, variables numaserve set).

    ``token``: the per-spawn secret the worker proves itself with in Hello
    (``numaserve.control.workerauth``), handed over in an inherited pipe
    whose fd number is in ``NUMASERVE_TOKEN_FD`` (to a forked worker: in the
    fork request).  ``forker``: the node templates' fork hook
    (``numaserve.supervisor.templates``); when it returns None the worker is
    exec'd as usual.  ``progress_file``: where the worker reports its load
    (``numaserve.progress``) until it is ready.
    """
    base = os.environ if environ is None else environ
    extra = numaserve_env(cfg, base, plan, generation, all_gpus)
    if cfg.server.cmd:
        argv = render_cmd(cfg.server.cmd, plan, generation, listeners)
        spec = None
        external = True
    else:
        spec = worker_spec(cfg, plan, generation, listeners, control, node_cpus)
        argv = [sys.executable, "-m", "numaserve.worker"]
        external = False
    env = worker_env(base, spec, extra)
    env.pop(PROGRESS_ENV, None)
    if progress_file and spec is not None:
        env[PROGRESS_ENV] = progress_file
    if forker is not None and spec is not None:
        env.pop(TOKEN_FD_ENV, None)
        forked = forker(plan, spec, env, listeners, token)
        if forked is not None:
            return forked, False, extra
    # exec'd (no template, or it declined): through the trampoline, bound before the interpreter starts
    launch = build_launch_argv(
        argv,
        cpus=plan.cpus,
        mempolicy=plan.mempolicy,
        nodes=plan.memory_nodes,
        ppid=os.getpid(),
    )
    token_fd = token_pipe(token) if token is not None and not external else -1
    env.pop(TOKEN_FD_ENV, None)
    if token_fd >= 0:
        env[TOKEN_FD_ENV] = str(token_fd)
    try:
        popen = subprocess.Popen(
            launch,
            pass_fds=[lst.fd for lst in listeners] + ([token_fd] if token_fd >= 0 else []),
            env=env,
            stdin=subprocess.DEVNULL,
            close_fds=True,
            process_group=0,
            cwd=cfg.server.app_dir or None,
        )
    finally:
        if token_fd >= 0:
            os.close(token_fd)  # the child has its own copy now (or there is no child)
    restore_child_nofile(popen.pid)
    return popen, external, extra
