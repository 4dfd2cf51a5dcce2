"""`numaserve ratelimit show | set | auto`: the limits each slot enforces, and overrides."""

from __future__ import annotations

import re
from typing import Any

import click

from numaserve.cli.common import echo_json, output_option, want_json
from numaserve.cli.ops_cmd import _call, ops_target_options
from numaserve.control.opsargs import RATE

MAX_CONCURRENCY = 1 << 20
_RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*(?:/s|rps|r/s)$", re.IGNORECASE)


def parse_limit(value: str) -> dict[str, Any]:
    """"32" → concurrency 32; "200/s" or "200rps" → rate 200 requests/s."""
    v = value.strip()
    m = _RATE.match(v)
    if m:
        try:   # the supervisor's range, checked here too: exit 2 before anything is sent
            return {"rate": RATE.check(f"rate {value!r}", float(m.group(1)))}
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="VALUE") from None
    if v.isdigit() and 1 <= int(v) <= MAX_CONCURRENCY:
        return {"concurrency": int(v)}
    raise click.BadParameter(f"{value!r}: expected a concurrency like 32 (at most {MAX_CONCURRENCY}) or a rate like 200/s", param_hint="VALUE")


@click.group("ratelimit")
def ratelimit() -> None:
    """Admission limits per slot: show them, override them, or hand back to auto."""


@ratelimit.command("show")
@ops_target_options
@output_option
def show(target: Any, reply_timeout: float, as_json: bool | None) -> None:
    """Per slot: limit, rate, epoch (pushed / applied by the worker), who set it and why."""
    data = _call(target, "ratelimit_show", timeout=reply_timeout)
    if want_json(as_json):
        echo_json(data)
        return
    for line in show_lines(data):
        click.echo(line)


def mode_line(data: dict[str, Any]) -> str:
    """The header: the configured mode, and the slots an operator override holds (the loops do not move them)."""
    held = [s["slot"] for s in data["slots"] if s.get("source") == "operator"]
    if not held:
        return f"mode {data['mode']}"
    which = "every slot" if len(held) == len(data["slots"]) else \
        ("slot " if len(held) == 1 else "slots ") + ",".join(str(x) for x in held)
    return f"mode {data['mode']}, operator override on {which} (until `numaserve ratelimit auto`)"


def applied(s: dict[str, Any]) -> str:
    """Whether the worker runs the epoch last pushed: "yes", else the older epoch it still runs."""
    have, want = s.get("applied_epoch"), s.get("epoch")
    if have is None:
        return "-"
    return "yes" if want is None or have >= want else f"epoch {have}"


def show_lines(data: dict[str, Any]) -> list[str]:
    """The text of ``ratelimit show`` (pure)."""
    out = [mode_line(data),
           f"{'SLOT':>4} {'NODE':>4} {'LIMIT':>6} {'RATE':>9} {'EPOCH':>6} {'APPLIED':>8} {'EFFECTIVE':>9}  SOURCE / WHY"]
    for s in data["slots"]:
        rate = "-" if s["rate"] is None else f"{s['rate']:.1f}/s"
        out.append(
            f"{s['slot']:>4} {s['node']:>4} {str(s['concurrency'] or '-'):>6} {rate:>9} {str(s['epoch'] or '-'):>6} "
            f"{applied(s):>8} {str(s['effective_limit'] or '-'):>9}  "
            f"{s['source'] or '-'}{' — ' + s['reason'] if s['reason'] and s['reason'] != s['source'] else ''}"
        )
    return out


@ratelimit.command("set")
@ops_target_options
@click.option("--slot", type=int, default=None)
@click.option("--node", type=int, default=None)
@click.argument("value")
def set_(target: Any, reply_timeout: float, slot: int | None, node: int | None, value: str) -> None:
    """Override: VALUE is a concurrency (32) or a rate (200/s) for a slot, a node, or every slot."""
    if slot is not None and node is not None:
        raise click.UsageError("give --slot or --node, not both")
    args: dict[str, Any] = parse_limit(value)
    if slot is not None:
        args["slot"] = slot
    elif node is not None:
        args["node"] = node
    else:
        args["all"] = True
    res = _call(target, "ratelimit_set", args, timeout=reply_timeout)
    acks = (res or {}).get("acks") or {} if isinstance(res, dict) else {}
    ok = sum(1 for a in acks.values() if a.get("ok"))
    click.echo(f"set {value} on " + (f"slot {slot}" if slot is not None else f"node {node}" if node is not None
                                     else "every slot") + f", applied by {ok}/{len(acks)} workers"
               + (f" in {res['acked_in_ms']} ms" if isinstance(res, dict) and res.get("acked_in_ms") is not None
                  else "") + " (until `numaserve ratelimit auto`)")
    for key, a in sorted(acks.items()):
        if not a.get("ok"):
            click.echo(f"  slot {key}: not applied: {a.get('detail')}", err=True)


@ratelimit.command("auto")
@ops_target_options
@click.option("--slot", type=int, default=None)
@click.option("--node", type=int, default=None)
def auto(target: Any, reply_timeout: float, slot: int | None, node: int | None) -> None:
    """Clear overrides (of a slot, a node, or everything): the control loops decide again."""
    args: dict[str, Any] = {}
    if slot is not None:
        args["slot"] = slot
    if node is not None:
        args["node"] = node
    res = _call(target, "ratelimit_auto", args, timeout=reply_timeout)
    acks = (res or {}).get("acks") or {} if isinstance(res, dict) else {}
    ok = sum(1 for a in acks.values() if a.get("ok"))
    where = f"slot {slot}" if slot is not None else f"node {node}" if node is not None else "every slot"
    ms = res.get("acked_in_ms") if isinstance(res, dict) else None
    click.echo(f"auto on {where}: operator overrides cleared, the control loops decide again; "
               f"applied by {ok}/{len(acks)} workers" + (f" in {ms} ms" if ms is not None else ""))
    for key, a in sorted(acks.items()):
        if not a.get("ok"):
            click.echo(f"  slot {key}: not applied: {a.get('detail')}", err=True)
