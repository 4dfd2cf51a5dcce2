"""`numaserve start` (placeholder until implemented)."""

import click

from numaserve.errors import NumaserveError


@click.command("start")
def start() -> None:
    """Not implemented yet."""
    raise NumaserveError("start: not implemented yet")
