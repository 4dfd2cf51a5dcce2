"""Ops commands against a running supervisor (placeholder)."""

import click

from numaserve.errors import NumaserveError


@click.command("status")
def status() -> None:
    """Not implemented yet."""
    raise NumaserveError("status: not implemented yet")


@click.command("stop")
def stop() -> None:
    """Not implemented yet."""
    raise NumaserveError("stop: not implemented yet")
