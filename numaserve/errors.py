"""Errors that reach the operator as one clear line (never a traceback)."""

from __future__ import annotations


class NumaserveError(Exception):
    """An error with a message fit for an operator; ``exit_code`` is the CLI status."""

    exit_code = 1

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(NumaserveError):
    """Bad input from the operator: CLI arguments, node specs, config. Exit status 2."""

    exit_code = 2


class ConfigError(UsageError):
    """A config file, environment variable or flag has a bad value."""


class TopologyError(NumaserveError):
    """The machine cannot be read well enough to go on."""
