"""Helpers shared by CLI commands: output mode, config loading from flags."""

from __future__ import annotations

import functools
import json
import math
from typing import Any, Callable, Mapping

import click

from numaserve.config import Config, load_config


def want_json(flag: bool | None) -> bool:
    """JSON only when asked (``--json``, ``-o json``): a table otherwise, terminal or not.

    ``watch numaserve status`` and ``... | grep`` want what a person reads;
    scripts ask for JSON explicitly (as with kubectl and systemctl).
    """
    return bool(flag)


def output_option(fn: Callable[..., Any] | None = None, *, short: bool = True) -> Any:
    """``--json/--no-json`` and ``-o/--output json|table``, collapsed into one ``as_json`` argument.

    ``short=False``: only ``--json/--no-json``, for a command whose ``-o/--output`` names a file.
    """

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def wrapper(*args: Any, as_json: bool | None, output_format: str | None = None, **kw: Any) -> Any:
            if output_format is not None:
                chosen = output_format.lower() == "json"
                if as_json is not None and as_json != chosen:
                    raise click.UsageError(f"--output {output_format} and --{'' if as_json else 'no-'}json "
                                           "disagree: give one")
                as_json = chosen
            return f(*args, as_json=as_json, **kw)

        if short:
            wrapper = click.option("-o", "--output", "output_format", default=None,
                                   type=click.Choice(["json", "table"], case_sensitive=False),
                                   help="Output format (kubectl's spelling of --json / --no-json).")(wrapper)
        return click.option("--json/--no-json", "as_json", default=None,
                            help="JSON for scripts (default: human-readable, whether stdout is a terminal or not)."
                            )(wrapper)

    return decorate(fn) if fn is not None else decorate


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


class FiniteFloat(click.ParamType):
    """A number option that must be finite and in range (click's float takes "nan" and "inf").

    A NaN timeout never expires (``restart --drain-timeout nan`` kept the old
    worker retiring forever): refused with exit 2 naming the option.
    """

    name = "number"

    def __init__(self, minimum: float = 0.0, maximum: float | None = None, *, min_open: bool = False) -> None:
        self.minimum, self.maximum, self.min_open = minimum, maximum, min_open

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float) and math.isfinite(value):
            v = value
        else:
            try:
                v = float(value)
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not a number", param, ctx)
        low = f"> {self.minimum:g}" if self.min_open else f">= {self.minimum:g}"
        high = "" if self.maximum is None else f" and <= {self.maximum:g}"
        if not math.isfinite(v):
            self.fail(f"{value!r}: expected a finite number {low}{high}", param, ctx)
        if (v <= self.minimum if self.min_open else v < self.minimum) or (self.maximum is not None and v > self.maximum):
            self.fail(f"{value!r}: expected a number {low}{high}", param, ctx)
        return v


#: Seconds for timeouts and deadlines on the command line (a week at most, as the ops handlers accept).
SECONDS = FiniteFloat(0.0, 7 * 86400.0)
POSITIVE_SECONDS = FiniteFloat(0.0, 7 * 86400.0, min_open=True)


def config_from_flags(
    config_path: str | None, overrides: Mapping[str, Mapping[str, Any]] | None = None, ctx: click.Context | None = None
) -> Config:
    """Load the effective config; the global --log-level flag is an override too."""
    ov: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (overrides or {}).items()}
    ctx = ctx or click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    if root is not None and root.obj and root.obj.get("log_level") and ov.get("log", {}).get("level") is None:
        ov.setdefault("log", {})["level"] = root.obj["log_level"]  # a command's own --log-level wins
    return load_config(config_path, ov)


config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    envvar="NUMASERVE_CONFIG",
    help="Config file (TOML). Default: /etc/numaserve/numaserve.toml when present.",
)
