"""`numaserve cache purge [--prefix P] | bump | version`: the workers' response caches.

``purge`` and ``bump`` print one line per worker with its acknowledgement
and exit with status 1 when any worker did not confirm (it may be hung or
just restarting: its cache is then empty, or gets the version on start).
"""

from __future__ import annotations

from typing import Any

import click

from numaserve.cli.common import FiniteFloat, echo_json, output_option, want_json
from numaserve.cli.ops_cmd import _call, ops_target_options
from numaserve.control.opsargs import ACK_TIMEOUT

json_option = output_option
ack_timeout_option = click.option("--ack-timeout", type=FiniteFloat(ACK_TIMEOUT.minimum, ACK_TIMEOUT.maximum), default=5.0, show_default=True,
                                  help="Seconds each worker has to acknowledge.")


def _report(data: dict[str, Any], headline: str, as_json: bool | None) -> None:
    if want_json(as_json):
        echo_json(data)
    else:
        click.echo(headline)
        for slot, ack in sorted(data["acks"].items(), key=lambda kv: kv[0]):
            mark = "ok" if ack.get("ok") else "FAILED"
            click.echo(f"  slot {slot:>8}  pid {ack.get('pid')!s:>7}  gen {ack.get('generation')!s:>3}  "
                       f"{mark:6}  {ack.get('detail', '')}")
        if not data["acks"]:
            click.echo("  (no live workers)")
    if data["failed"]:
        raise click.exceptions.Exit(1)


@click.group("cache")
def cache() -> None:
    """Response caches of the workers: purge entries or bump the version."""


@cache.command("purge")
@ops_target_options
@click.option("--prefix", default="", help="Only entries whose path starts with this (default: everything).")
@ack_timeout_option
@json_option
def purge(target: Any, reply_timeout: float, prefix: str, ack_timeout: float, as_json: bool | None) -> None:
    """Drop cached responses on every worker; each worker acknowledges."""
    data = _call(target, "cache_purge", {"prefix": prefix, "timeout": ack_timeout},
                 timeout=max(reply_timeout, ack_timeout + 2))
    _report(data, f"purge {prefix or '(everything)'}: {len(data['acks'])} workers, "
                  f"{len(data['failed'])} without ack", as_json)


@cache.command("bump")
@ops_target_options
@ack_timeout_option
@json_option
def bump(target: Any, reply_timeout: float, ack_timeout: float, as_json: bool | None) -> None:
    """Raise the cache version on every worker (and on workers started later): old entries miss."""
    data = _call(target, "cache_bump", {"timeout": ack_timeout}, timeout=max(reply_timeout, ack_timeout + 2))
    _report(data, f"cache version {data['version']}: {len(data['acks'])} workers, "
                  f"{len(data['failed'])} without ack", as_json)


@cache.command("version")
@ops_target_options
@json_option
def version(target: Any, reply_timeout: float, as_json: bool | None) -> None:
    """The current cache version."""
    data = _call(target, "cache_version", timeout=reply_timeout)
    if want_json(as_json):
        echo_json(data)
    else:
        click.echo(str(data["version"]))
