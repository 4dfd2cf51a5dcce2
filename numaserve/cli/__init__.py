"""The ``numaserve`` command.

Every subcommand lives in its own module here; this file only builds the
group and turns ``NumaserveError`` into one line on stderr with its exit
status (2 for usage and config errors), never a traceback.
"""

from __future__ import annotations

import importlib
import sys

import click

from numaserve import __version__
from numaserve.errors import NumaserveError

# command name -> "module:attribute"; imported only when the command runs, so
# `numaserve status` does not pay for importing the HTTP stack.
COMMANDS: dict[str, str] = {
    "topology": "numaserve.cli.topology_cmd:topology",
    "plan": "numaserve.cli.plan_cmd:plan",
    "config": "numaserve.cli.config_cmd:config",
    "exec": "numaserve.cli.exec_cmd:exec_",
    "start": "numaserve.cli.start_cmd:start",
    "status": "numaserve.cli.ops_cmd:status",
    "stop": "numaserve.cli.ops_cmd:stop",
    "drain": "numaserve.cli.ops_cmd:drain",
    "undrain": "numaserve.cli.ops_cmd:undrain",
    "restart": "numaserve.cli.ops_cmd:restart",
    "reload": "numaserve.cli.ops_cmd:reload",
    "operation": "numaserve.cli.ops_cmd:operation",
    "top": "numaserve.cli.ops_cmd:top",
    "ops": "numaserve.cli.ops_cmd:ops",
    "ratelimit": "numaserve.cli.ratelimit_cmd:ratelimit",
    "systemd": "numaserve.cli.systemd_cmd:systemd",
    "loadtest": "numaserve.cli.loadtest_cmd:loadtest",
    "profile": "numaserve.cli.profile_cmd:profile",
    "cache": "numaserve.cli.cache_cmd:cache",
    "irq": "numaserve.cli.irq_cmd:irq",
    "doctor": "numaserve.cli.doctor_cmd:doctor",
    "model": "numaserve.cli.model_cmd:model",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(COMMANDS))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        from numaserve.cli.globalopts import attach_globals, global_options

        cmd = super().get_command(ctx, name)
        if cmd is None and name in COMMANDS:
            mod, _, attr = COMMANDS[name].partition(":")
            cmd = getattr(importlib.import_module(mod), attr)
        return None if cmd is None else attach_globals(cmd, global_options(self))


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="numaserve")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default=None,
    help="Log level (overrides log.level from the config).",
)
@click.pass_context
def cli(ctx: click.Context, log_level: str | None) -> None:
    """NUMA-aware serving supervisor: one pinned, memory-bound worker per NUMA node."""
    from numaserve.cli.globalopts import store_global

    store_global(ctx, "log_level", log_level)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    try:
        rv = cli.main(args=argv, prog_name="numaserve", standalone_mode=False)
    except NumaserveError as e:
        click.echo(f"numaserve: error: {e}", err=True)
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        click.echo("numaserve: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        if isinstance(e, click.exceptions.NoSuchOption):
            from numaserve.cli.flaghints import explain

            explain(e)
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except BrokenPipeError:
        sys.exit(141)
    except KeyboardInterrupt:
        sys.exit(130)
    except OSError as e:  # the environment, not a bug: say which file and why
        where = f" on {e.filename}" if e.filename else ""
        reason = "permission denied" if isinstance(e, PermissionError) else (e.strerror or str(e)).lower()
        click.echo(f"numaserve: error: {reason}{where}", err=True)
        sys.exit(1)
    except Exception as e:  # a bug: one line for the operator, the traceback on request
        import os
        import traceback

        if os.environ.get("NUMASERVE_DEBUG"):
            traceback.print_exc()
        click.echo(
            f"numaserve: internal error: {type(e).__name__}: {e} "
            "(set NUMASERVE_DEBUG=1 for the traceback, and please report it)",
            err=True,
        )
        sys.exit(70)
    sys.exit(rv if isinstance(rv, int) else 0)
