"""`numaserve start`: run the supervisor in the foreground (systemd style)."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import click

from numaserve.cli.common import SECONDS, config_from_flags, config_option
from numaserve.errors import UsageError


def parse_workers_per_node(value: str | None) -> int | str | None:
    if value is None:
        return None
    v = value.strip().lower()
    if v == "auto":
        return "auto"
    if not v.isdigit() or int(v) < 1:
        raise UsageError(f'--workers-per-node {value!r}: expected an integer >= 1 or "auto"')
    return int(v)


@click.command("start")
@click.argument("app_arg", metavar="[APP]", required=False, default=None)
@config_option
@click.option("--nodes", default=None, help='NUMA nodes to serve on: "all" or a list like 0,2-3.')
@click.option("--workers-per-node", default=None, help='Workers per node: N or "auto".')
@click.option("--bind", "binds", multiple=True,
              help="HOST:PORT to listen on (repeatable; [::]:PORT for IPv6; unix:/PATH for a unix socket).")
@click.option("--slots", default=None, type=click.Choice(["node", "core", "l3", "gpu"]),
              help="Slot shape: one worker per node (workers_per_node), physical core, L3 cache group or GPU.")
@click.option("--app", default=None, help="ASGI app as module:attr (default: the embedded demo app).")
@click.option("--cmd", default=None, help='External server command per slot, e.g. "uvicorn app:app --fd {fd}".')
@click.option("--app-dir", default=None, help="Directory prepended to sys.path before importing --app.")
@click.option("--preload", default=None,
              help="module:function run once after the app is imported (in each node's warm template).")
@click.option("--worker-start", default=None, type=click.Choice(["fork", "exec"]),
              help="fork workers from a warm per-node template, or exec each one ([worker] start).")
@click.option("--backlog", type=int, default=None, help="Listen backlog of every slot's socket.")
@click.option("--runtime-dir", default=None, help="Runtime directory for control sockets (mode 0700).")
@click.option("--root", default=None, help="sysfs/procfs root to discover (for testing on dumps).")
@click.option("--declared", default=None, help="Declared topology file (pretend or corrected nodes).")
@click.option("--mempolicy", default=None, type=click.Choice(["bind", "preferred", "interleave", "local"]))
@click.option("--steering", default=None, type=click.Choice(["hash", "numa"]),
              help="Connection steering: kernel hash, or to a slot on the receiving CPU's node.")
@click.option("--takeover", is_flag=True, default=None,
              help="Start even when another process listens on a bind address, sharing it (an upgrade).")
@click.option("--allow-host-port", is_flag=True, default=None,
              help="Let --cmd use {host}/{port} (the command then binds its own sockets; see docs/serving.md).")
@click.option("--log-level", "log_level",
              type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False), default=None,
              help="Log level (log.level); the same as `numaserve --log-level ... start`.")
@click.option("--access-log/--no-access-log", "access_log", default=None,
              help="One log line per request, with its duration (server.access_log).")
@click.option("--access-log-format", default=None,
              help='gunicorn-style access line, e.g. \'%(h)s "%(r)s" %(s)s %(b)s %(D)sus\' (fields: docs/serving.md).')
@click.option("--proxy-headers/--no-proxy-headers", "proxy_headers", default=None,
              help="Trust X-Forwarded-For/-Proto from --forwarded-allow-ips (server.proxy_headers).")
@click.option("--forwarded-allow-ips", default=None,
              help='Comma-separated proxy addresses or CIDRs trusted for proxy headers, "*" for all.')
@click.option("--root-path", default=None, help='ASGI root_path when mounted below a prefix, e.g. "/api".')
@click.option("--timeout-keep-alive", type=SECONDS, default=None,
              help="Seconds an idle keep-alive connection stays open (server.keepalive_timeout).")
@click.option("--max-requests", type=click.IntRange(min=0), default=None,
              help="Recycle a worker after this many requests, make-before-break (0 = never).")
@click.option("--max-requests-jitter", type=click.IntRange(min=0), default=None,
              help="Add 0..N random requests to each worker's --max-requests, so they do not recycle together.")
@click.option("--max-lifetime", type=SECONDS, default=None,
              help="Recycle a worker after this many seconds, plus up to 10 %% jitter (0 = never).")
@click.pass_context
def start(
    ctx: click.Context,
    config_path: str | None,
    nodes: str | None,
    workers_per_node: str | None,
    slots: str | None,
    binds: tuple[str, ...],
    app: str | None,
    cmd: str | None,
    app_dir: str | None,
    preload: str | None,
    worker_start: str | None,
    backlog: int | None,
    runtime_dir: str | None,
    root: str | None,
    declared: str | None,
    mempolicy: str | None,
    steering: str | None,
    takeover: bool | None,
    allow_host_port: bool | None,
    app_arg: str | None = None,
    log_level: str | None = None,
    access_log: bool | None = None,
    access_log_format: str | None = None,
    proxy_headers: bool | None = None,
    forwarded_allow_ips: str | None = None,
    root_path: str | None = None,
    timeout_keep_alive: float | None = None,
    max_requests: int | None = None,
    max_requests_jitter: int | None = None,
    max_lifetime: float | None = None,
) -> None:
    """Start one pinned, memory-bound worker per NUMA node and supervise them.

    Runs in the foreground. SIGTERM/SIGINT stop gracefully (in-flight requests
    finish up to server.graceful_timeout); a second signal stops fast.
    Exit status: 0 graceful stop, 1 fatal error, 2 bad config or arguments
    (including a bind address another process listens on), 3 no slot could
    start (e.g. the app does not import), 4 stopped but workers had to be
    killed.
    """
    if app_arg is not None:
        if app is not None:
            raise UsageError(f"the app is given twice (APP {app_arg!r} and --app {app!r}): give one")
        app = app_arg
    if log_level:   # the group's --log-level, given after the subcommand: one value either way
        ctx.find_root().ensure_object(dict)["log_level"] = log_level.lower()
    if app and cmd:
        raise UsageError("--app and --cmd exclude each other: give one")
    server: dict[str, object] = {
        "bind": list(binds) if binds else None,
        "app": app,
        "cmd": cmd,
        "app_dir": app_dir,
        "backlog": backlog,
        "steering": steering,
        "takeover": takeover or None,
        "access_log": access_log,
        "access_log_format": access_log_format,
        "proxy_headers": proxy_headers,
        "forwarded_allow_ips": _ip_list(forwarded_allow_ips),
        "root_path": root_path,
        "keepalive_timeout": timeout_keep_alive,
    }
    # a flag choosing one kind of worker clears the other kind set in the file
    if app:
        server["cmd"] = ""
    if cmd:
        server["app"] = ""
    overrides = {
        "server": server,
        "placement": {
            "nodes": nodes,
            "workers_per_node": parse_workers_per_node(workers_per_node),
            "sysfs_root": root,
            "topology_file": declared,
            "mempolicy": mempolicy,
            "slots": slots,
        },
        "supervisor": {"runtime_dir": runtime_dir},
        "cmd": {"allow_host_port": allow_host_port or None},
        "worker": {"preload": preload, "start": worker_start, "max_requests": max_requests,
                   "max_requests_jitter": max_requests_jitter, "max_lifetime": max_lifetime},
    }
    cfg = config_from_flags(config_path, overrides, ctx)

    from numaserve.log import configure_logging

    configure_logging(cfg.log.level, cfg.log.format, stream=sys.stderr, process="supervisor")

    from numaserve.net.listeners import resolve_binds
    from numaserve.net.portowners import check_binds
    from numaserve.runtime import RuntimeDir, resolve_runtime_dir
    from numaserve.supervisor.arbiter import Supervisor
    from numaserve.supervisor.prepare import prepare

    # Everything that can refuse the start runs before the runtime directory
    # is touched and before any socket listens: a refused start changes nothing.
    binds = resolve_binds(cfg.server.bind)
    topo, plan = prepare(cfg)
    import structlog

    runtime = RuntimeDir(resolve_runtime_dir(cfg.supervisor.runtime_dir))
    runtime.refuse_if_held()
    import socket

    from numaserve.net.unixbind import check_unix_path

    for b in binds:   # a live server on a unix path refuses the start (a stale file is replaced at open)
        if b.family == socket.AF_UNIX:
            check_unix_path(b.host)
    binds = [b for b in binds if b.family != socket.AF_UNIX]
    for warning in check_binds(binds, takeover=cfg.server.takeover):
        structlog.get_logger("numaserve.supervisor").warning("port_shared", detail=warning)
    sup = Supervisor(cfg, plan, runtime, config_path=config_path, topology=topo, overrides=_flag_overrides(ctx, overrides))
    try:
        sup.open()
    except BaseException:
        sup.close()
        raise
    code = asyncio.run(_serve(sup))
    if sup.table.fatal:
        click.echo(f"numaserve: error: {sup.table.fatal}", err=True)
    ctx.exit(code)


def _ip_list(text: str | None) -> list[str] | None:
    """--forwarded-allow-ips "10.0.0.1, 10.1.0.0/16" as a list (checked by the config like the key)."""
    if text is None:
        return None
    return [p.strip() for p in text.split(",") if p.strip()]


def _flag_overrides(ctx: click.Context, overrides: dict[str, dict[str, object]]) -> dict[str, dict[str, object]]:
    """The flags as config overrides, kept so a reload re-reads the file under the same flags."""
    out = {k: {kk: vv for kk, vv in v.items() if vv is not None} for k, v in overrides.items()}
    root = ctx.find_root()
    if root.obj and root.obj.get("log_level"):
        out.setdefault("log", {})["level"] = root.obj["log_level"]
    return out


async def _serve(sup: Any) -> int:
    """The supervisor's life, plus the one-shot trim of its start-up garbage once every slot serves."""
    from numaserve.supervisor.settle import trim_once_settled

    settle = asyncio.ensure_future(trim_once_settled(lambda: sup.state))
    try:
        return await sup.run()
    finally:
        settle.cancel()
