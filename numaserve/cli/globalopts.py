"""Global options (``--log-level``) accepted after the subcommand as well.

``numaserve --log-level debug status`` and ``numaserve status --log-level
debug`` mean the same: every command gets a copy of each global option that
stores its value where the group's own option does (``ctx.find_root().obj``).
A command that defines the same flag itself keeps its own (it handles it).
The copy given after the subcommand wins over one given before it.
"""

from __future__ import annotations

from typing import Any

import click

_MARK = "_numaserve_globals_attached"


def store_global(ctx: click.Context, name: str, value: Any) -> None:
    """Record a global option's value on the root context (None: not given, keep what is there)."""
    root = ctx.find_root()
    root.ensure_object(dict)
    if value is None:
        root.obj.setdefault(name, None)
        return
    root.obj[name] = value.lower() if isinstance(value, str) else value


def _copy(opt: click.Option) -> click.Option:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is not None:
            store_global(ctx, opt.name or "", value)

    return click.Option(list(opt.opts), type=opt.type, default=None, expose_value=False, callback=callback,
                         help=(opt.help or "").rstrip(".") + " (global: before or after the command).",
                         metavar=opt.metavar)


def global_options(group: click.Group) -> list[click.Option]:
    """The group's own value options (not --help/--version, which act at once)."""
    return [p for p in group.params if isinstance(p, click.Option) and p.expose_value and not p.is_eager]


def attach_globals(cmd: click.Command, options: list[click.Option]) -> click.Command:
    """Give ``cmd`` (and every subcommand of a group) a copy of each global option it lacks; idempotent."""
    if getattr(cmd, _MARK, False):
        return cmd
    taken = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    for opt in options:
        if not taken.intersection(opt.opts):
            cmd.params.append(_copy(opt))
    setattr(cmd, _MARK, True)
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            attach_globals(sub, options)
    return cmd
