"""`numaserve topology` (placeholder until implemented)."""

import click

from numaserve.errors import NumaserveError


@click.command("topology")
def topology() -> None:
    """Not implemented yet."""
    raise NumaserveError("topology: not implemented yet")
