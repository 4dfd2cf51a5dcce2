"""Ops commands that talk to a running supervisor over its ops socket.

Every command names where it looked when the supervisor cannot be reached,
and long operations (drain, reload, restart) print progress with ``--wait``
and exit non-zero when the operation failed or timed out with work left.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any, Callable

import click

from numaserve.cli.common import (POSITIVE_SECONDS, SECONDS, config_from_flags, config_option, echo_json, output_option,
                                  want_json)
from numaserve.cli.fit import Column, fit_table, terminal_width, wrap_parts
from numaserve.cpulist import format_list
from numaserve.errors import NumaserveError


def ops_target_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--config/--runtime-dir/--endpoint/--curve-*/--timeout, collapsed into ``target``."""

    @config_option
    @click.option("--runtime-dir", default=None, help="Runtime directory of the supervisor (default: as `start` resolves it).")
    @click.option("--endpoint", default=None, help="Remote supervisor: tcp://HOST:PORT (CURVE; see ops.tcp_endpoint).")
    @click.option("--curve-key", default=None, type=click.Path(dir_okay=False), help="Your CURVE certificate (secret).")
    @click.option("--curve-server-key", default=None, type=click.Path(dir_okay=False),
                  help="The supervisor's public CURVE certificate.")
    @click.option("--timeout", "reply_timeout", type=POSITIVE_SECONDS, default=5.0, show_default=True,
                  help="Seconds to wait for a reply.")
    @functools.wraps(fn)
    def wrapper(config_path: str | None, runtime_dir: str | None, endpoint: str | None, curve_key: str | None,
                curve_server_key: str | None, reply_timeout: float, **kw: Any) -> Any:
        from numaserve.control.client import OpsTarget

        target = OpsTarget(
            runtime_dir=None if endpoint else _runtime(config_path, runtime_dir),
            endpoint=endpoint,
            curve_key=curve_key,
            curve_server_key=curve_server_key,
        )
        return fn(target=target, reply_timeout=reply_timeout, **kw)

    return wrapper


def _runtime(config_path: str | None, runtime_dir: str | None) -> Path:
    from numaserve.errors import ConfigError
    from numaserve.runtime import resolve_runtime_dir

    if runtime_dir:
        return Path(runtime_dir)
    try:
        cfg = config_from_flags(config_path)
    except ConfigError as e:
        # A broken file on disk must not cut the operator off from a supervisor that
        # runs with the config it loaded (`reload` then refuses this one, with the
        # reason): find it where an unconfigured runtime_dir would be.
        click.echo(f"warning: {e}; looking for the supervisor in the default runtime directory", err=True)
        return resolve_runtime_dir("")
    return resolve_runtime_dir(cfg.supervisor.runtime_dir)


def _call(target: Any, verb: str, args: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
    from numaserve.control.client import OpsError, ops_call, socket_present

    try:
        return ops_call(target, verb, args, timeout=timeout)
    except OpsError as e:
        if target.runtime_dir is not None and not target.readonly and "permission denied" in str(e):
            # members of ops.readonly_group may still read through ops-ro.sock
            ro = type(target)(runtime_dir=target.runtime_dir, readonly=True)
            if verb in ("status", "operation") and socket_present(ro.runtime_dir / "ops-ro.sock"):
                return ops_call(ro, verb, args, timeout=timeout)
        raise


def _state(s: dict[str, Any]) -> str:
    """The slot state, plus what an operator needs next to it (steered away, when a retry comes)."""
    st = str(s["state"])
    load = s.get("loading")
    if isinstance(load, dict):   # elapsed, and the app's own progress when it reports it
        st += f" {_duration(load.get('elapsed_s') or 0)}"
        if load.get("fraction") is not None:
            st += f" {load['fraction'] * 100:.0f}%"
        if load.get("note"):
            st += f" {str(load['note'])[:24]}"
    if s.get("condition"):
        st += f",{s['condition']}"
    if s.get("unresponsive_s") is not None:
        st += f",silent {s['unresponsive_s']:.0f}s"
    if s.get("retry_in_s") is not None:
        st += f",retry {_duration(s['retry_in_s'])}"
    return st


def _mb(n: int | None) -> str:
    """45.3M, 1.15G: memory sizes short enough for a column."""
    if not n:
        return "-"
    mib = n / 1048576
    return f"{mib:.1f}M" if mib < 1000 else f"{mib / 1024:.2f}G"


_STATUS_COLUMNS = (  # natural order; priority: what stays on the slot's line at 80 columns
    Column("slot", "slot", 0, right=True),
    Column("node", "node", 3, right=True),
    Column("pid", "pid", 2, right=True),
    Column("gen", "gen", 8, right=True),
    Column("state", "state", 1),
    Column("cpus", "cpus", 9),
    Column("mempolicy", "mempolicy", 10, short="policy"),
    Column("binding", "binding", 11, quiet=("", "-", "verified")),
    Column("rss", "rss", 6, right=True),
    Column("up", "up", 7, right=True),
    Column("restarts", "restarts", 5, right=True, short="rst"),
    Column("requests", "requests", 4, right=True, short="reqs"),
    Column("inflight", "inflight", 4, right=True, short="infl"),
    Column("reason", "reason", 12),
    Column("local", "local mem", 10, right=True, short="local"),
    Column("offnode", "threads off node", 13, right=True, short="off", quiet=("", "-", "0")),
)


def _duration(seconds: float) -> str:
    """42s, 17m, 3.5h, 12d: short enough for a column."""
    if seconds < 100:
        return f"{seconds:.0f}s"
    if seconds < 6000:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.0f}d"


def _locality_cells(s: dict[str, Any]) -> dict[str, str]:
    """``local`` (share of its anonymous memory on the slot's node) and ``offnode`` (threads last run
    on another node's CPUs) from the slot's ``locality`` sample; "-" before the first sample."""
    loc = s.get("locality") or {}
    ratio, off = loc.get("local_ratio"), loc.get("threads_off_node")
    local = "-" if ratio is None else ("100%" if ratio >= 1 else f"{min(ratio * 100, 99.9):.1f}%")
    return {"local": local, "offnode": "-" if off is None else str(off)}


def status_lines(data: dict[str, Any], width: int) -> list[str]:
    """The text of ``numaserve status`` for a terminal ``width`` columns wide (pure)."""
    sup = data["supervisor"]
    steer = sup.get("steering") or {}
    out = wrap_parts([f"supervisor pid {sup['pid']}", f"state {sup['state']}", f"up {_duration(sup['uptime_s'])}",
                      f"listening {', '.join(sup['listeners'])}", f"steering {steer.get('mode', '-')}"], width)
    rows = []
    for s in data["slots"]:
        verified = s["binding_verified"]
        pol = s["mempolicy"] + (":" + format_list(s["memory_nodes"]) if s["memory_nodes"] else "")
        rows.append({
            "slot": str(s["slot"]), "node": str(s["node"]), "pid": str(s["pid"] or "-"),
            "gen": str(s["generation"] or "-"), "state": _state(s), "cpus": format_list(s["cpus"]),
            "mempolicy": pol,
            "binding": "verified" if verified else ("-" if verified is None else "MISMATCH"),
            "rss": _mb(s["rss_bytes"]), "up": _duration(s["uptime_s"]) if s["pid"] else "-",  # no worker: no age
            "restarts": str(s["restarts"]),
            "requests": str(s["requests"]), "inflight": str(s["inflight"]),
            "reason": s["failed_reason"] or s["last_restart_reason"] or "",
            **_locality_cells(s),
        })
    out += fit_table(_STATUS_COLUMNS, rows, width)
    from numaserve.cli.template_view import template_lines

    out += template_lines(data, width, wrap_parts)
    for s in data["slots"]:
        for p in s.get("binding_problems") or []:
            out += wrap_parts([f"slot {s['slot']}: {p}"], width)
    refused = refusals_by_reason(data)
    if refused:
        out += wrap_parts(["refused (since start):", *(f"{k} {v}" for k, v in refused.items())], width)
    for op in data.get("operations") or []:
        if op["state"] == "running":
            last = op["steps"][-1]["message"] if op["steps"] else ""
            out += wrap_parts([f"operation {op['id']} {op['kind']} running {op['elapsed_s']:.0f}s:", last], width)
    return out


def refusals_by_reason(data: dict[str, Any]) -> dict[str, int]:
    """Requests refused by admission, summed over the slots' lifetime totals, by reason, most first
    (the fixed set of ``numaserve.refusals``: ``cpu``, ``stalled``, ``limit``, ``quota``, ...)."""
    out: dict[str, int] = {}
    for s in data["slots"]:
        by = (s.get("totals") or {}).get("shed_by_reason") or {}
        for k, v in by.items():
            if isinstance(v, int) and v > 0:
                out[str(k)] = out.get(str(k), 0) + v
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def _render_status(data: dict[str, Any]) -> None:
    for line in status_lines(data, terminal_width()):
        click.echo(line)


@click.command("status")
@ops_target_options
@output_option
@click.option("--latency", is_flag=True, help="Per-slot latency histogram and p50/p90/p99 from the cumulative buckets.")
def status(target: Any, reply_timeout: float, as_json: bool | None, latency: bool) -> None:
    """Show every slot of the running supervisor."""
    data = _call(target, "status", timeout=reply_timeout)
    if want_json(as_json):
        if latency:
            from numaserve.tools.latency_view import latency_summary

            data["latency"] = latency_summary(data)
        echo_json(data)
    else:
        _render_status(data)
        if latency:
            from rich.console import Console

            from numaserve.tools.latency_view import render_latency

            Console().print(render_latency(data))


@click.command("stop")
@ops_target_options
@click.option("--fast", is_flag=True, help="Kill workers at once instead of letting in-flight requests finish.")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until the supervisor has exited.")
@click.option("--wait-timeout", type=POSITIVE_SECONDS, default=60.0, show_default=True)
def stop(target: Any, reply_timeout: float, fast: bool, wait: bool, wait_timeout: float) -> None:
    """Stop the running supervisor (graceful unless --fast)."""
    from numaserve.runtime import read_pid

    pid = read_pid(target.runtime_dir) if target.runtime_dir else None
    _call(target, "stop", {"fast": fast}, timeout=reply_timeout)
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
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------- operations


def _slot_args(slot: int | None, node: int | None) -> dict[str, Any]:
    if slot is not None and node is not None:
        raise click.UsageError("give --slot or --node, not both")
    args: dict[str, Any] = {}
    if slot is not None:
        args["slot"] = slot
    if node is not None:
        args["node"] = node
    return args


def follow(target: Any, result: dict[str, Any], *, wait: bool, as_json: bool | None, reply_timeout: float,
           limit: float | None) -> None:
    """Print an operation's progress until it ends (with --wait); exit 1 when it failed.

    Progress goes to stderr, table or JSON alike (``reload --wait | tee log``
    still shows it live); stdout gets only the outcome.
    """
    op = result["operation"]
    quiet = want_json(as_json)
    if not wait:
        if quiet:
            echo_json(result)
        else:
            click.echo(f"operation {op['id']} ({op['kind']}) started")
        return
    click.echo(f"operation {op['id']} ({op['kind']}) started", err=True)
    seen = 0
    deadline = None if limit is None else time.monotonic() + limit
    while True:
        for step in op["steps"][seen:]:
            click.echo(f"  +{step['t']:7.2f}s  {step['message']}", err=True)
        seen = len(op["steps"])
        if op["state"] != "running":
            break
        if deadline is not None and time.monotonic() > deadline:
            raise NumaserveError(f"operation {op['id']} still running after {limit:g}s")
        time.sleep(0.25)
        op = _call(target, "operation", {"id": op["id"]}, timeout=reply_timeout)["operation"]
    if quiet:
        echo_json({"operation": op, "state": op["state"]})
    if op["state"] != "succeeded":
        raise NumaserveError(f"{op['kind']} {op['id']} failed: {op['result']}")
    if not quiet:
        click.echo(f"{op['kind']} {op['id']} succeeded: {op['result']}")


def show_operation(result: dict[str, Any], as_json: bool | None) -> None:
    """One operation as it is now: its steps and, when it has ended, its outcome (exit 1 if failed)."""
    op = result["operation"]
    if want_json(as_json):
        echo_json(result)
    else:
        click.echo(f"operation {op['id']} ({op['kind']}) {op['state']} after {op['elapsed_s']:.1f}s")
        for step in op["steps"]:
            click.echo(f"  +{step['t']:7.2f}s  {step['message']}")
        if op["state"] == "running":
            click.echo(f"still running: `numaserve operation {op['id']} --wait` follows it")
        elif op["state"] == "succeeded":
            click.echo(f"{op['kind']} {op['id']} succeeded: {op['result']}")
    if op["state"] not in ("running", "succeeded"):
        raise NumaserveError(f"{op['kind']} {op['id']} {op['state']}: {op['result']}")


wait_option = click.option("--wait/--no-wait", default=False, help="Follow progress until the operation ends.")
json_option = output_option


@click.command("drain")
@ops_target_options
@click.option("--slot", type=int, default=None, help="Slot to take out of service.")
@click.option("--node", type=int, default=None, help="Every slot of this NUMA node.")
@click.option("--drain-timeout", "drain_timeout", type=SECONDS, default=None,
              help="Seconds in-flight and streaming requests get (default server.graceful_timeout).")
@wait_option
@json_option
def drain(target: Any, reply_timeout: float, slot: int | None, node: int | None, drain_timeout: float | None,
          wait: bool, as_json: bool | None) -> None:
    """Stop new connections reaching slots, let their work finish, stop their workers."""
    args = _slot_args(slot, node)
    if not args:
        raise click.UsageError("name the slots: --slot S or --node N")
    if drain_timeout is not None:
        args["timeout"] = drain_timeout
    res = _call(target, "drain", args, timeout=reply_timeout)
    follow(target, res, wait=wait, as_json=as_json, reply_timeout=reply_timeout,
           limit=(drain_timeout or 3600) + 30)


@click.command("undrain")
@ops_target_options
@click.option("--slot", type=int, default=None)
@click.option("--node", type=int, default=None)
@wait_option
@json_option
def undrain(target: Any, reply_timeout: float, slot: int | None, node: int | None, wait: bool,
            as_json: bool | None) -> None:
    """Put drained slots back into service (every drained slot when none is named)."""
    res = _call(target, "undrain", _slot_args(slot, node) or {"all": True}, timeout=reply_timeout)
    follow(target, res, wait=wait, as_json=as_json, reply_timeout=reply_timeout, limit=None)


@click.command("restart")
@ops_target_options
@click.option("--slot", type=int, default=None)
@click.option("--node", type=int, default=None)
@click.option("--drain-timeout", "drain_timeout", type=SECONDS, default=None)
@wait_option
@json_option
def restart(target: Any, reply_timeout: float, slot: int | None, node: int | None, drain_timeout: float | None,
            wait: bool, as_json: bool | None) -> None:
    """Replace workers one at a time: new one ready first, then the old one drains."""
    args = _slot_args(slot, node)
    if not args:
        raise click.UsageError("name the slots: --slot S or --node N (or use `numaserve reload` for all)")
    if drain_timeout is not None:
        args["timeout"] = drain_timeout
    res = _call(target, "restart", args, timeout=reply_timeout)
    follow(target, res, wait=wait, as_json=as_json, reply_timeout=reply_timeout, limit=None)


@click.command("reload")
@ops_target_options
@click.option("--drain-timeout", "drain_timeout", type=SECONDS, default=None)
@wait_option
@json_option
def reload(target: Any, reply_timeout: float, drain_timeout: float | None, wait: bool,
           as_json: bool | None) -> None:
    """Re-read config and app code, then roll every slot onto them (also: SIGHUP)."""
    args: dict[str, Any] = {}
    if drain_timeout is not None:
        args["timeout"] = drain_timeout
    res = _call(target, "reload", args, timeout=reply_timeout)
    follow(target, res, wait=wait, as_json=as_json, reply_timeout=reply_timeout, limit=None)


@click.command("operation")
@ops_target_options
@click.argument("op_id", required=False)
@wait_option
@json_option
def operation(target: Any, reply_timeout: float, op_id: str | None, wait: bool, as_json: bool | None) -> None:
    """Show one operation (or the recent ones), optionally following it."""
    res = _call(target, "operation", {"id": op_id} if op_id else {}, timeout=reply_timeout)
    if op_id:
        if wait:
            follow(target, res, wait=True, as_json=as_json, reply_timeout=reply_timeout, limit=None)
        else:
            show_operation(res, as_json)
        return
    if want_json(as_json):
        echo_json(res)
        return
    for op in res["operations"]:
        click.echo(f"{op['id']}  {op['kind']:8} {op['state']:10} {op['elapsed_s']:8.1f}s  {op['result']}")


# -------------------------------------------------------------------- top


@click.command("top")
@click.option("--runtime-dir", default=None)
@config_option
@click.option("--interval", type=POSITIVE_SECONDS, default=1.0, show_default=True, help="Refresh interval (seconds).")
@click.option("--iterations", type=int, default=0, help="Stop after N refreshes (0: until Ctrl-C).")
@json_option
def top(runtime_dir: str | None, config_path: str | None, interval: float, iterations: int,
        as_json: bool | None) -> None:
    """Live per-slot view: state, requests/s, latency, in-flight, RSS and its trend (q or Ctrl-C quits).

    Fed by the supervisor's ZeroMQ PUB stream (events.sock, topic "stats"),
    which any other tool can subscribe to as well.
    """
    import zmq

    from numaserve.runtime import EVENTS_SOCKET

    from numaserve.control.client import socket_present

    rt = _runtime(config_path, runtime_dir)
    path = rt / EVENTS_SOCKET
    if not socket_present(path):
        raise NumaserveError(f"no supervisor is running with runtime directory {rt} ({path} does not exist)")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"stats")
    sub.connect(f"ipc://{path}")
    silence = max(5.0, 3 * interval)
    view = TopView()
    n = 0
    live = None
    json_out = want_json(as_json)
    from numaserve.cli.keys import Keys

    keys = Keys(enabled=not json_out).__enter__()   # left in the finally below, whatever happens
    try:
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        if keys.fd is not None:
            poller.register(keys.fd, zmq.POLLIN)
        if not json_out:
            from rich.live import Live

            live = Live(view.table(), refresh_per_second=4, screen=False)
            live.start()
        last = 0.0
        heard = time.monotonic()
        while True:
            ready = dict(poller.poll(200))
            if keys.fd is not None and keys.fd in ready and _quits(keys.read()):
                break
            if sub not in ready:
                if time.monotonic() - heard > silence:
                    raise NumaserveError(f"no stats from the supervisor on ipc://{path} (is it running?)")
                continue
            _, payload = sub.recv_multipart()
            heard = time.monotonic()
            data = json.loads(payload)
            view.update(data)
            if time.monotonic() - last < interval * 0.9:
                continue
            last = time.monotonic()
            n += 1
            if json_out:
                click.echo(json.dumps(view.rows()))
            elif live is not None:
                live.update(view.table())
            if iterations and n >= iterations:
                break
    except KeyboardInterrupt:
        pass
    finally:
        if live is not None:
            live.stop()
        keys.__exit__(None, None, None)
        sub.close(0)


def _quits(typed: str) -> bool:
    """q or Q quits top, as in top(1); end of input too (the terminal went away)."""
    return typed == "" or "q" in typed.lower()


class TopView:
    """Derives rates and trends from successive stats snapshots (pure)."""

    def __init__(self) -> None:
        self.prev: dict[tuple[int, int], tuple[float, int]] = {}
        self.rss_hist: dict[int, list[tuple[float, int]]] = {}
        self.data: dict[str, Any] = {"slots": []}
        self.rates: dict[int, float] = {}

    def update(self, data: dict[str, Any]) -> None:
        ts = float(data.get("ts", time.time()))
        for s in data.get("slots", []):
            key = (s["slot"], s["generation"])
            req = int(s.get("requests") or 0)
            if key in self.prev:
                t0, r0 = self.prev[key]
                if ts > t0:
                    self.rates[s["slot"]] = max(0.0, (req - r0) / (ts - t0))
            self.prev[key] = (ts, req)
            hist = self.rss_hist.setdefault(s["slot"], [])
            hist.append((ts, int(s.get("rss_bytes") or 0)))
            del hist[:-30]
        self.data = data

    def rss_trend(self, slot: int) -> float | None:
        """RSS change in MB per minute over the recent window."""
        hist = self.rss_hist.get(slot) or []
        if len(hist) < 2 or hist[-1][0] - hist[0][0] < 1.0:
            return None
        (t0, r0), (t1, r1) = hist[0], hist[-1]
        return (r1 - r0) / 1048576 / ((t1 - t0) / 60)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per slot; ``rps`` is None until two snapshots of the same worker gave a rate."""
        out = []
        for s in self.data.get("slots", []):
            lat = s.get("latency_ms") or {}
            extra = s.get("limits") or {}
            rate = self.rates.get(s["slot"])
            trend = self.rss_trend(s["slot"])
            out.append({
                "slot": s["slot"], "node": s["node"], "pid": s["pid"], "generation": s["generation"],
                "state": s["state"], "rps": None if rate is None else round(rate, 1),
                "p50_ms": lat.get("p50"), "p99_ms": lat.get("p99"), "inflight": s.get("inflight"),
                "queued": s.get("queued", 0), "shed": s.get("shed", 0), "rss_bytes": s.get("rss_bytes"),
                "rss_trend_mb_min": None if trend is None else round(trend, 2),
                "limits": extra,
                "local_ratio": (s.get("locality") or {}).get("local_ratio"),
                "threads_off_node": (s.get("locality") or {}).get("threads_off_node"),
            })
        return out

    @property
    def warming_up(self) -> bool:
        """No rate is known yet for a serving slot (the first snapshot only gives counts)."""
        if not self.prev:
            return True  # no snapshot yet
        return any(s["slot"] not in self.rates and s.get("pid") for s in self.data.get("slots", []))

    def lines(self, width: int) -> list[str]:
        """The text of one ``top`` frame, ``width`` columns wide (pure)."""
        title = f"numaserve top — {self.data.get('state', '?')}"
        if self.warming_up:
            title += " — warming up (rates after the next update)"
        rows = []
        for r in self.rows():
            trend = r["rss_trend_mb_min"]
            lim = r["limits"].get("concurrency") if isinstance(r["limits"], dict) else None
            rows.append({
                "slot": str(r["slot"]), "node": str(r["node"]), "pid": str(r["pid"] or "-"),
                "gen": str(r["generation"] or "-"), "state": r["state"],
                "rps": "…" if r["rps"] is None else f"{r['rps']:.1f}",
                "p50": _fmt(r["p50_ms"]), "p99": _fmt(r["p99_ms"]), "inflight": str(r["inflight"] or 0),
                "queued": str(r["queued"] or 0), "shed": str(r["shed"] or 0), "rss": _mb(r["rss_bytes"]),
                "trend": "-" if trend is None else f"{trend:+.1f}M/min", "limit": "-" if lim is None else str(lim),
                **_locality_cells({"locality": {"local_ratio": r["local_ratio"],
                                                "threads_off_node": r["threads_off_node"]}}),
            })
        return wrap_parts([title], width) + fit_table(_TOP_COLUMNS, rows, width, details=False)

    def table(self, width: int | None = None) -> Any:
        from rich.text import Text

        return Text("\n".join(self.lines(width or terminal_width())), no_wrap=True)


_TOP_COLUMNS = (
    Column("slot", "slot", 0, right=True),
    Column("node", "node", 6, right=True),
    Column("pid", "pid", 9, right=True),
    Column("gen", "gen", 12, right=True),
    Column("state", "state", 1),
    Column("rps", "req/s", 2, right=True),
    Column("p50", "p50 ms", 4, right=True, short="p50"),
    Column("p99", "p99 ms", 3, right=True, short="p99"),
    Column("inflight", "inflight", 5, right=True, short="infl"),
    Column("queued", "queued", 7, right=True, short="q", quiet=("", "-", "0")),
    Column("shed", "shed", 8, right=True, quiet=("", "-", "0")),
    Column("rss", "rss", 10, right=True),
    Column("trend", "rss trend", 11, right=True, short="trend"),
    Column("limit", "limit", 13, right=True, short="lim"),
    Column("local", "local mem", 14, right=True, short="local"),
    Column("offnode", "threads off node", 15, right=True, short="off", quiet=("", "-", "0")),
)


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{float(v):.1f}"


# -------------------------------------------------------------------- keys


@click.group("ops")
def ops() -> None:
    """Ops-plane utilities."""


@ops.command("keygen")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default="numaserve", show_default=True)
def keygen(directory: str, name: str) -> None:
    """Create a CURVE key pair (NAME.key public, NAME.key_secret secret) for remote ops."""
    import os

    import zmq.auth

    from numaserve.runtime import tight_umask

    with tight_umask():
        os.makedirs(directory, mode=0o700, exist_ok=True)
        public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    click.echo(f"public: {public}\nsecret: {secret}")
