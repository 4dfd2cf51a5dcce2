"""Helpers shared by CLI commands: output mode, config loading from flags."""

from __future__ import annotations

import json
import sys
from typing import Any, Mapping

import click

from numaserve.config import Config, load_config


def want_json(flag: bool | None) -> bool:
    """JSON when asked, or when stdout is not a terminal (stable for scripts)."""
    if flag is not None:
        return flag
    return not sys.stdout.isatty()


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def config_from_flags(
    config_path: str | None, overrides: Mapping[str, Mapping[str, Any]] | None = None, ctx: click.Context | None = None
) -> Config:
    """Load the effective config; the global --log-level flag is an override too."""
    ov: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (overrides or {}).items()}
    ctx = ctx or click.get_current_context(silent=True)
    root = ctx.find_root() if ctx is not None else None
    if root is not None and root.obj and root.obj.get("log_level"):
        ov.setdefault("log", {})["level"] = root.obj["log_level"]
    return load_config(config_path, ov)


config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    envvar="NUMASERVE_CONFIG",
    help="Config file (TOML). Default: /etc/numaserve/numaserve.toml when present.",
)
