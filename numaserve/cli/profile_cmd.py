"""``numaserve profile``: a py-spy profile of one slot's live worker.

The worker pid comes from the supervisor's status, so the operator names a
slot, not a pid that may have changed with the last restart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from numaserve.cli.common import echo_json, output_option, want_json
from numaserve.cli.ops_cmd import _call, ops_target_options
from numaserve.errors import UsageError
from numaserve.tools.profiling import FORMATS, default_output, record, slot_worker_pid


class _OneLineErrors(click.Command):
    """Click's usage errors as one ``numaserve: error:`` line (exit 2)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            raise UsageError(f"profile: {e.format_message()}") from None


@click.command("profile", cls=_OneLineErrors)
@ops_target_options
@click.option("--slot", type=int, required=True, help="Slot whose current worker to sample.")
@click.option("--duration", type=click.IntRange(1, 3600), default=10, show_default=True,
              help="Seconds to sample.")
@click.option("--format", "fmt", type=click.Choice(list(FORMATS)), default="flamegraph", show_default=True,
              help="flamegraph (SVG), speedscope (JSON for speedscope.app) or raw (collapsed stacks).")
@click.option("-o", "--output", type=click.Path(), default=None,
              help="File to write (default: numaserve-slotS-pidP-TIME.EXT here; a directory: inside it).")
@click.option("--rate", type=click.IntRange(1, 10000), default=100, show_default=True, help="Samples per second.")
@click.option("--native", is_flag=True, help="Include native (C/Cython) frames.")
@click.option("--idle", is_flag=True, help="Include idle threads' stacks (a quiet worker has no others).")
@click.option("--nonblocking", is_flag=True,
              help="Do not pause the worker while sampling (less impact on latency, less accurate).")
@output_option(short=False)
def profile(target: Any, reply_timeout: float, slot: int, duration: int, fmt: str, output: str | None,
            rate: int, native: bool, idle: bool, nonblocking: bool, as_json: bool | None) -> None:
    """Sample slot S's worker with py-spy and write a flame graph or profile."""
    if target.endpoint:
        raise UsageError("profile runs py-spy on this host: run it on the supervisor's host, without --endpoint")
    pid = slot_worker_pid(_call(target, "status", timeout=reply_timeout), slot)
    out = _output_path(output, slot, pid, fmt)
    quiet = want_json(as_json)
    if not quiet:
        click.echo(f"profiling slot {slot} (pid {pid}) for {duration}s at {rate} Hz ...", err=True)
    res = record(pid, duration=duration, fmt=fmt, output=out, rate=rate, native=native, idle=idle,
                 nonblocking=nonblocking)
    if quiet:
        echo_json({"slot": slot, **res.to_dict()})
        return
    n = "" if res.samples is None else f", {res.samples} samples"
    click.echo(f"wrote {fmt} of slot {slot} (pid {pid}{n}): {res.output}")
    if res.samples == 0:
        click.echo("note: no samples; the worker was idle: put load on it or pass --idle", err=True)


def _output_path(output: str | None, slot: int, pid: int, fmt: str) -> Path:
    if output is None:
        return default_output(slot, pid, fmt)
    p = Path(output)
    if p.is_dir():
        return p / default_output(slot, pid, fmt)
    if not p.parent.is_dir():
        raise UsageError(f"--output: directory {p.parent} does not exist")
    return p
