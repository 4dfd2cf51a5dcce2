"""Unknown command-line flags: say what numaserve does instead.

Operators come from uvicorn and gunicorn and type their flags.  click's own
"did you mean" picks the nearest spelling, which can be another thing
entirely (``--reload`` → ``--preload``, ``--root-path`` → ``--root``): for
the flags in ``EQUIVALENTS`` the message names numaserve's equivalent
instead, and a nearest spelling that only shares a prefix is not offered.
"""

from __future__ import annotations

import click

#: uvicorn/gunicorn flag → what numaserve does instead (one sentence, no trailing period).
EQUIVALENTS: dict[str, str] = {
    "--workers": "numaserve runs workers per NUMA node: `numaserve start --workers-per-node N` (or \"auto\")",
    "-w": "numaserve runs workers per NUMA node: `numaserve start --workers-per-node N` (or \"auto\")",
    "--host": "give host and port together: `numaserve start --bind HOST:PORT` (repeatable)",
    "--port": "give host and port together: `numaserve start --bind HOST:PORT` (repeatable)",
    "-b": "numaserve spells it `--bind HOST:PORT` (repeatable)",
    "--fd": "the supervisor owns the listeners: run another server with "
            "`numaserve start --cmd \"uvicorn app:app --fd {fd}\"`",
    "--reload": "numaserve does not watch files: `numaserve reload` (or SIGHUP to the supervisor) re-reads the "
                "config and app code and rolls every slot onto them",
    "--timeout": "set server.graceful_timeout (how long in-flight requests get at stop) or "
                 "supervisor.heartbeat_timeout (when a silent worker is replaced) in the config",
    "--graceful-timeout": "set server.graceful_timeout in the config (or NUMASERVE_SERVER_GRACEFUL_TIMEOUT)",
    "--uds": "bind a unix socket the supervisor owns: `numaserve start --bind unix:/run/numaserve.sock`",
    "--keep-alive": "numaserve spells it `--timeout-keep-alive SECONDS` (server.keepalive_timeout)",
    "--limit-concurrency": "set server.max_connections in the config, or per slot at run time with "
                           "`numaserve ratelimit set N`",
    "--loop": "set server.loop in the config (auto, uvloop or asyncio)",
    "--http": "set server.http in the config (auto, httptools or h11)",
    "--daemon": "numaserve runs in the foreground under systemd: `numaserve systemd install`",
    "-D": "numaserve runs in the foreground under systemd: `numaserve systemd install`",
    "--pid": "the supervisor writes its pid into the runtime directory (--runtime-dir)",
}


def _same_prefix(wrong: str, suggestion: str) -> bool:
    """``--root`` for ``--root-path``: a shorter flag the typed one merely extends names another thing."""
    return wrong.startswith(suggestion + "-") or suggestion.startswith(wrong + "-")


def explain(e: click.exceptions.NoSuchOption) -> None:
    """Rewrite ``e`` in place: numaserve's equivalent for a known foreign flag, no misleading suggestion."""
    name = e.option_name.split("=", 1)[0]
    hint = EQUIVALENTS.get(name)
    if hint is not None:
        e.message = f"No such option {name!r}: {hint}."
        e.possibilities = None
        return
    if e.possibilities:
        kept = [p for p in e.possibilities if not _same_prefix(name, p)]
        e.possibilities = kept or None
