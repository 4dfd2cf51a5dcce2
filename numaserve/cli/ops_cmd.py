"""Ops commands that talk to a running supervisor over its ops socket."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from numaserve.cli.common import config_from_flags, config_option, echo_json, want_json
from numaserve.cpulist import format_list

runtime_dir_option = click.option(
    "--runtime-dir", default=None, help="Runtime directory of the supervisor (default: as `start` resolves it)."
)
timeout_option = click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds to wait for a reply.")


def _runtime(config_path: str | None, runtime_dir: str | None) -> Path:
    from numaserve.runtime import resolve_runtime_dir

    if runtime_dir:
        return Path(runtime_dir)
    cfg = config_from_flags(config_path)
    return resolve_runtime_dir(cfg.supervisor.runtime_dir)


def _mb(n: int | None) -> str:
    return "-" if not n else f"{n / 1048576:.1f}M"


def _render_status(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    sup = data["supervisor"]
    console = Console()
    console.print(
        f"supervisor pid {sup['pid']}  state [bold]{sup['state']}[/]  up {sup['uptime_s']:.0f}s  "
        f"listening {', '.join(sup['listeners'])}"
    )
    t = Table(show_edge=False, header_style="bold")
    for col in ("slot", "node", "pid", "gen", "state", "cpus", "mempolicy", "binding", "rss", "up",
                "restarts", "requests", "inflight", "last restart"):
        t.add_column(col)
    for s in data["slots"]:
        verified = s["binding_verified"]
        binding = "verified" if verified else ("-" if verified is None else "MISMATCH")
        pol = s["mempolicy"] + (":" + format_list(s["memory_nodes"]) if s["memory_nodes"] else "")
        t.add_row(
            str(s["slot"]), str(s["node"]), str(s["pid"] or "-"), str(s["generation"]), s["state"],
            format_list(s["cpus"]), pol, binding, _mb(s["rss_bytes"]), f"{s['uptime_s']:.0f}s",
            str(s["restarts"]), str(s["requests"]), str(s["inflight"]),
            s["failed_reason"] or s["last_restart_reason"] or "",
        )
    console.print(t)
    for s in data["slots"]:
        for p in s.get("binding_problems") or []:
            console.print(f"[red]slot {s['slot']}: {p}[/]")


@click.command("status")
@config_option
@runtime_dir_option
@timeout_option
@click.option("--json/--no-json", "as_json", default=None, help="JSON output (default when not a tty).")
def status(config_path: str | None, runtime_dir: str | None, timeout: float, as_json: bool | None) -> None:
    """Show every slot of the running supervisor."""
    from numaserve.control.client import ops_call

    data = ops_call(_runtime(config_path, runtime_dir), "status", timeout=timeout)
    if want_json(as_json):
        echo_json(data)
    else:
        _render_status(data)


@click.command("stop")
@config_option
@runtime_dir_option
@timeout_option
@click.option("--fast", is_flag=True, help="Kill workers at once instead of letting in-flight requests finish.")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until the supervisor has exited.")
@click.option("--wait-timeout", type=float, default=60.0, show_default=True)
def stop(config_path: str | None, runtime_dir: str | None, timeout: float, fast: bool, wait: bool, wait_timeout: float) -> None:
    """Stop the running supervisor (graceful unless --fast)."""
    from numaserve.control.client import ops_call
    from numaserve.errors import NumaserveError
    from numaserve.runtime import read_pid

    rt = _runtime(config_path, runtime_dir)
    pid = read_pid(rt)
    ops_call(rt, "stop", {"fast": fast}, timeout=timeout)
    if not wait or pid is None:
        click.echo("stopping")
        return
    deadline = time.monotonic() + wait_timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            click.echo(f"stopped (pid {pid})")
            return
        time.sleep(0.1)
    raise NumaserveError(f"supervisor pid {pid} still running after {wait_timeout:g}s")


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours would count as alive; the supervisor is not our child
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
