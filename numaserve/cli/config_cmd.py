"""`numaserve config check FILE` and `numaserve config show`.

``check`` validates a file before it is deployed (CI, config management):
one line, exit 0 or 2.  ``show`` prints the effective config after defaults,
file, environment and flags are merged, so an operator sees what `start`
would actually use.
"""

from __future__ import annotations

import click

from numaserve.cli.common import config_from_flags, config_option, echo_json, output_option, want_json
from numaserve.config import config_to_toml, load_config


@click.group("config")
def config() -> None:
    """Check or show the configuration."""


@config.command("check")
@click.argument("file", type=click.Path())
def check(file: str) -> None:
    """Validate FILE with the NUMASERVE_* environment applied.

    Prints "FILE: ok" (exit 0) or one error line naming the source, key,
    value and what was expected (exit 2).
    """
    load_config(file)
    click.echo(f"{file}: ok")


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
