"""`numaserve exec` (placeholder until implemented)."""

import click

from numaserve.errors import NumaserveError


@click.command("exec")
def exec_() -> None:
    """Not implemented yet."""
    raise NumaserveError("exec: not implemented yet")
