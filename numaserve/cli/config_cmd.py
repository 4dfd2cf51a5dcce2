"""`numaserve config check FILE` and `numaserve config show`.

``check`` validates a file before it is deployed (CI, config management):
one line, exit 0 or 2.  ``show`` prints the effective config after defaults,
file, environment and flags are merged, so an operator sees what `start`
would actually use.
"""

from __future__ import annotations

import click

from numaserve.cli.common import config_from_flags, config_option, echo_json, output_option, want_json
from numaserve.config import config_to_toml


@click.group("config")
def config() -> None:
    """Check or show the configuration."""


@config.command("check")
@click.argument("file", type=click.Path())
def check(file: str) -> None:
    """Validate FILE with the NUMASERVE_* environment applied, as `start` would.

    Everything `start` refuses before binding is checked (bind addresses this
    machine has, the cmd template, TLS files, topology and plan).  Prints
    "FILE: ok" (exit 0), or one line per error, "FILE:LINE: key = value:
    expected ..." with the closest key for a misspelled one (exit 2).
    """
    import os

    from numaserve.cli.config_check import check_file

    problems = check_file(file, os.environ)
    if not problems:
        click.echo(f"{file}: ok")
        return
    for p in problems:
        click.echo(f"numaserve: error: {p}", err=True)
    if len(problems) > 1:
        click.echo(f"numaserve: error: {file}: {len(problems)} errors", err=True)
    raise click.exceptions.Exit(2)


@config.command("show")
@config_option
@output_option
def show(config_path: str | None, as_json: bool | None) -> None:
    """Print the effective config: defaults < file < environment < flags."""
    cfg = config_from_flags(config_path)
    if want_json(as_json):
        echo_json(cfg.to_dict())
    else:
        click.echo(config_to_toml(cfg).rstrip("\n"))
