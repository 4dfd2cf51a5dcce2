"""`numaserve systemd`: install the systemd unit, its user and the config.

The unit file shipped in ``systemd/numaserve.service`` is the single source:
``install`` copies it with every ``/usr/local/bin/numaserve`` replaced by the
numaserve actually installed (so ExecStart never points at nothing) and the
``--config`` path set.  It never runs systemctl unless ``--enable`` is given
and systemd is PID 1; ``--prefix`` installs into another root (packaging,
tests).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import click

from numaserve.cli.common import echo_json, output_option, want_json
from numaserve.config import DEFAULT_CONFIG_PATH
from numaserve.errors import NumaserveError, UsageError

UNIT_NAME = "numaserve.service"
TEMPLATE_BIN = "/usr/local/bin/numaserve"
UNIT_DIR = "/etc/systemd/system"
SYSUSERS_PATH = "/etc/sysusers.d/numaserve.conf"

_REPO = Path(__file__).resolve().parents[2]
# Source checkout first, then data files of an installed package.
_SEARCH = [_REPO, Path(sys.prefix) / "share" / "numaserve"]


@dataclass
class Action:
    """One file ``install`` writes (or would write, with --dry-run)."""

    path: str
    what: str
    action: str       # "create", "update", "unchanged", "keep" (exists, left alone)


def find_shipped(rel: str) -> Path | None:
    """A file shipped with numaserve (``systemd/...``, ``config/...``), or None."""
    for base in _SEARCH:
        p = base / rel
        if p.is_file():
            return p
    return None


def numaserve_command(argv0: str | None = None, executable: str | None = None) -> str:
    """How systemd should run numaserve: the numaserve of *this* installation.

    In order: the console script running now (``/opt/numaserve/bin/numaserve
    systemd install`` puts that venv in ExecStart whatever $PATH says), the
    console script beside this interpreter, the one on $PATH, else this
    interpreter with ``-m numaserve``.
    """
    argv0 = sys.argv[0] if argv0 is None else argv0
    executable = sys.executable if executable is None else executable
    candidates = []
    if os.path.basename(argv0) == "numaserve" and os.sep in argv0:
        candidates.append(argv0)
    if executable:
        candidates.append(os.path.join(os.path.dirname(executable), "numaserve"))
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return os.path.abspath(c)
    found = shutil.which("numaserve")
    if found:
        return os.path.abspath(found)
    return f"{shlex.quote(executable)} -m numaserve"


_HOME_DIRS = ("/home/", "/root/", "/run/user/")


def home_paths(exec_cmd: str, config_path: str) -> list[str]:
    """Paths the unit needs that ProtectHome=yes would hide."""
    paths = [w for w in shlex.split(exec_cmd) if w.startswith("/")] + [config_path]
    return [p for p in paths if p.startswith(_HOME_DIRS)]


def render_unit(template: str, *, exec_cmd: str, config_path: str) -> str:
    """The shipped unit with our numaserve and config path in every Exec line.

    When numaserve or the config lives under /home or /root (a virtualenv,
    pyenv), ProtectHome=yes would make ExecStart fail with 203/EXEC, so it
    becomes ProtectHome=read-only.
    """
    if not config_path.startswith("/"):
        raise UsageError(f"--config-path {config_path!r}: expected an absolute path (systemd runs from /)")
    text = template.replace(TEMPLATE_BIN, exec_cmd)
    text = text.replace(f"--config {DEFAULT_CONFIG_PATH}", f"--config {shlex.quote(config_path)}")
    if home_paths(exec_cmd, config_path):
        text = text.replace("\nProtectHome=yes\n",
                            "\n# read-only, not yes: numaserve or its config is under /home or /root\n"
                            "ProtectHome=read-only\n")
    return text


def _under(prefix: Path, path: str) -> Path:
    return prefix / path.lstrip("/")


def _default_config_text() -> str:
    shipped = find_shipped("config/numaserve.toml")
    if shipped is not None:
        return shipped.read_text()
    from numaserve.config import config_to_toml, load_config

    return "# numaserve configuration (defaults; see `numaserve config show`)\n\n" + config_to_toml(
        load_config(None, environ={}, use_default_path=False))


def plan_install(prefix: Path, config_path: str, exec_cmd: str) -> list[tuple[Action, str | None, int]]:
    """What to write: (action, content or None for "keep", mode)."""
    tpl = find_shipped(f"systemd/{UNIT_NAME}")
    if tpl is None:
        raise NumaserveError(
            f"cannot find the unit template systemd/{UNIT_NAME} (looked in {', '.join(map(str, _SEARCH))})"
        )
    out: list[tuple[Action, str | None, int]] = []

    def add(path: str, what: str, content: str, mode: int, *, overwrite: bool) -> None:
        target = _under(prefix, path)
        if target.exists():
            if not overwrite:
                out.append((Action(str(target), what, "keep"), None, mode))
                return
            same = target.read_text() == content
            out.append((Action(str(target), what, "unchanged" if same else "update"), content, mode))
        else:
            out.append((Action(str(target), what, "create"), content, mode))

    unit = render_unit(tpl.read_text(), exec_cmd=exec_cmd, config_path=config_path)
    add(f"{UNIT_DIR}/{UNIT_NAME}", "systemd unit", unit, 0o644, overwrite=True)
    users = find_shipped("systemd/numaserve.sysusers.conf")
    if users is not None:
        add(SYSUSERS_PATH, "system user (systemd-sysusers)", users.read_text(), 0o644, overwrite=True)
    add(config_path, "config", _default_config_text(), 0o644, overwrite=False)
    return out


def next_steps(actions: list[Action]) -> list[str]:
    steps = []
    if any(a.path.endswith("sysusers.d/numaserve.conf") and a.action in ("create", "update") for a in actions):
        steps.append("systemd-sysusers")
    steps.append("systemctl daemon-reload && systemctl enable --now numaserve")
    return steps


def systemd_is_pid1() -> bool:
    """sd_booted(3): systemd is the init system when /run/systemd/system exists."""
    return os.path.isdir("/run/systemd/system")


@click.group("systemd")
def systemd() -> None:
    """Run numaserve under systemd (unit file, user, config)."""


@systemd.command("install")
@click.option("--prefix", default="/", show_default=True, type=click.Path(file_okay=False),
              help="Install into this root instead of / (packaging, tests).")
@click.option("--config-path", default=DEFAULT_CONFIG_PATH, show_default=True,
              help="Config file the unit passes to `numaserve start --config`; installed from the example if absent.")
@click.option("--exec", "exec_cmd", default=None,
              help="numaserve command for ExecStart (default: the installed numaserve).")
@click.option("--dry-run", is_flag=True, help="Show what would be written; write nothing.")
@click.option("--enable", is_flag=True, help="Also run systemd-sysusers, daemon-reload and enable --now "
                                              "(only with --prefix / on a systemd-booted machine).")
@output_option
def install(prefix: str, config_path: str, exec_cmd: str | None, dry_run: bool, enable: bool,
            as_json: bool | None) -> None:
    """Install numaserve.service (Type=notify, watchdog, hardening), its user and config.

    Existing config is never overwritten; the unit is (put local changes in a
    drop-in: `systemctl edit numaserve`).
    """
    root = Path(prefix)
    cmd = exec_cmd or numaserve_command()
    if enable and (dry_run or root.resolve() != Path("/")):
        raise UsageError("--enable needs --prefix / and no --dry-run")
    if enable and not systemd_is_pid1():
        raise NumaserveError("--enable: systemd is not the init system here (no /run/systemd/system); "
                             "run the printed steps on the target machine")
    planned = plan_install(root, config_path, cmd)
    if not dry_run:
        for action, content, mode in planned:
            if content is None or action.action == "unchanged":
                continue
            target = Path(action.path)
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
                tmp = target.with_name(f".{target.name}.tmp")
                tmp.write_text(content)
                os.chmod(tmp, mode)
                os.replace(tmp, target)
            except OSError as e:
                raise NumaserveError(f"cannot write {target}: {e.strerror} (run as root, or use --prefix DIR)") from None
    actions = [a for a, _, _ in planned]
    steps = next_steps(actions)
    warnings = [
        f"{p} is under a home directory: the unit's user (numaserve) must be able to read it; "
        "prefer a system-wide install (e.g. a virtualenv in /opt/numaserve) or --exec"
        for p in home_paths(cmd, config_path)
    ]
    for w in warnings:
        click.echo(f"warning: {w}", err=True)
    ran: list[str] = []
    if enable:
        for step in steps:
            subprocess.run(step, shell=True, check=True)
            ran.append(step)
    if want_json(as_json):
        echo_json({"dry_run": dry_run, "exec": cmd, "config_path": config_path, "prefix": str(root),
                   "files": [asdict(a) for a in actions], "warnings": warnings, "next_steps": [] if enable else steps, "ran": ran})
        return
    verb = "would " if dry_run else ""
    for a in actions:
        label = {"create": f"{verb}create", "update": f"{verb}update", "unchanged": "unchanged",
                 "keep": "exists, kept"}[a.action]
        click.echo(f"{label:>16}  {a.path}  ({a.what})")
    if dry_run:
        return
    if enable:
        click.echo("enabled and started: systemctl status numaserve")
        return
    click.echo("\nnext steps (as root):")
    for step in steps:
        click.echo(f"  {step}")
    click.echo("  systemctl status numaserve; journalctl -u numaserve -f")
    click.echo("examples: drop-ins in " + str(find_shipped("systemd/numaserve.service.d/10-example.conf")
                                              or "systemd/numaserve.service.d/"))


@systemd.command("unit")
@click.option("--config-path", default=DEFAULT_CONFIG_PATH, show_default=True)
@click.option("--exec", "exec_cmd", default=None, help="numaserve command for ExecStart.")
def unit(config_path: str, exec_cmd: str | None) -> None:
    """Print the unit file `install` would write."""
    tpl = find_shipped(f"systemd/{UNIT_NAME}")
    if tpl is None:
        raise NumaserveError(f"cannot find the unit template systemd/{UNIT_NAME}")
    click.echo(render_unit(tpl.read_text(), exec_cmd=exec_cmd or numaserve_command(), config_path=config_path),
               nl=False)


__all__ = ["install", "plan_install", "render_unit", "systemd", "unit"]
