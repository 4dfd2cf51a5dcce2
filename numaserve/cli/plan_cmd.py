"""`numaserve plan` (placeholder until implemented)."""

import click

from numaserve.errors import NumaserveError


@click.command("plan")
def plan() -> None:
    """Not implemented yet."""
    raise NumaserveError("plan: not implemented yet")
