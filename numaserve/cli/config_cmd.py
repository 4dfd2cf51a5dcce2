"""`numaserve config` (placeholder until implemented)."""

import click

from numaserve.errors import NumaserveError


@click.command("config")
def config() -> None:
    """Not implemented yet."""
    raise NumaserveError("config: not implemented yet")
