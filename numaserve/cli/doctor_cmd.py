"""`numaserve doctor`: check host settings against the config.

A table on a terminal (verdict, check, summary, fix), JSON otherwise.  Exit
status 0 when no check fails, 1 when any does, 2 on usage errors.
"""

from __future__ import annotations

import shutil
import textwrap

import click

from numaserve.cli.common import config_from_flags, config_option, echo_json, output_option, want_json
from numaserve.tools.doctor import Check, run_checks
from numaserve.errors import NumaserveError, UsageError
from numaserve.cpulist import parse_node_spec
from numaserve.topology.model import Topology


def _discover(root: str, declared: str | None) -> Topology:
    try:
        from numaserve.topology import discover  # type: ignore[attr-defined]
    except ImportError:
        raise NumaserveError("doctor: topology discovery (numaserve.topology.discover) is not available") from None
    return discover(root, declared=declared)


_MARK = {"ok": "ok", "info": "info", "warn": "WARN", "fail": "FAIL"}
_COLOR = {"ok": "green", "info": "blue", "warn": "yellow", "fail": "red"}


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, max(30, width), break_on_hyphens=False, break_long_words=False) or [""]


def _table(checks: list[Check], color: bool, verbose: bool = False) -> None:
    width = max(60, shutil.get_terminal_size((100, 20)).columns)
    idw = max(len(c.id) for c in checks)
    indent = " " * (8 + idw + 2)
    click.echo(f"{'VERDICT':<8}{'CHECK':<{idw + 2}}SUMMARY / FIX")
    for c in checks:
        mark = _MARK[c.verdict]
        head = click.style(f"{mark:<8}", fg=_COLOR[c.verdict], bold=c.verdict == "fail") if color else f"{mark:<8}"
        summary = _wrap(c.summary, width - len(indent))
        click.echo(f"{head}{c.id:<{idw + 2}}{summary[0]}")
        for line in summary[1:]:
            click.echo(indent + line)
        if verbose and c.detail:
            for para in c.detail.splitlines():
                for line in _wrap(para, width - len(indent) - 2):
                    click.echo(indent + "  " + line)
        if c.fix and c.verdict != "ok":
            for i, line in enumerate(_wrap(c.fix, width - len(indent) - 5)):
                click.echo(indent + ("fix: " if i == 0 else "     ") + line)
    counts = {v: sum(1 for c in checks if c.verdict == v) for v in ("fail", "warn", "info", "ok")}
    click.echo(", ".join(f"{n} {v}" for v, n in counts.items()))


@click.command("doctor")
@config_option
@click.option("--root", default=None, help="sysfs/procfs root (default: placement.sysfs_root, /).")
@click.option("--declared", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Declared topology file (default: placement.topology_file).")
@click.option("--nodes", default=None, help='Nodes to check for usable CPUs (default: placement.nodes).')
@output_option
@click.option("-v", "--verbose", is_flag=True, help="Also print each check's detail.")
@click.pass_context
def doctor(ctx: click.Context, config_path: str | None, root: str | None, declared: str | None,
           nodes: str | None, as_json: bool | None, verbose: bool) -> None:
    """Check irqbalance, sysctls, THP, limits and cpusets against the config."""
    cfg = config_from_flags(config_path)
    root = root or cfg.placement.sysfs_root or "/"
    declared = declared or cfg.placement.topology_file or None
    requested = None
    if nodes is not None:
        try:
            spec = parse_node_spec(nodes)
        except ValueError as e:
            raise UsageError(f"--nodes {nodes!r}: {e}") from None
        requested = list(spec) if spec is not None else None
    topo = _discover(root, declared)
    checks = run_checks(topo, cfg, requested_nodes=requested)
    failed = any(c.verdict == "fail" for c in checks)
    if want_json(as_json):
        echo_json({"root": root, "ok": not failed, "checks": [c.to_json() for c in checks]})
    else:
        _table(checks, color=click.get_text_stream("stdout").isatty(), verbose=verbose)
    ctx.exit(1 if failed else 0)
