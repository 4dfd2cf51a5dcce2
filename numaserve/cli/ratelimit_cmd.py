"""`numaserve ratelimit show | set | auto`: the limits each slot enforces, and overrides."""

from __future__ import annotations

import re
from typing import Any

import click

from numaserve.cli.common import echo_json, want_json
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
@click.option("--json/--no-json", "as_json", default=None)
def show(target: Any, reply_timeout: float, as_json: bool | None) -> None:
    """Per slot: limit, rate, epoch (pushed / applied by the worker), who set it and why."""
    data = _call(target, "ratelimit_show", timeout=reply_timeout)
    if want_json(as_json):
        echo_json(data)
        return
    click.echo(f"mode {data['mode']}")
    click.echo(f"{'SLOT':>4} {'NODE':>4} {'LIMIT':>6} {'RATE':>9} {'EPOCH':>6} {'APPLIED':>7} {'EFFECTIVE':>9}  SOURCE / WHY")
    for s in data["slots"]:
        rate = "-" if s["rate"] is None else f"{s['rate']:.1f}/s"
        click.echo(
            f"{s['slot']:>4} {s['node']:>4} {str(s['concurrency'] or '-'):>6} {rate:>9} {str(s['epoch'] or '-'):>6} "
            f"{str(s['applied_epoch'] or '-'):>7} {str(s['effective_limit'] or '-'):>9}  "
            f"{s['source'] or '-'}{' — ' + s['reason'] if s['reason'] and s['reason'] != s['source'] else ''}"
        )


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
    _call(target, "ratelimit_auto", args, timeout=reply_timeout)
    click.echo("auto")
