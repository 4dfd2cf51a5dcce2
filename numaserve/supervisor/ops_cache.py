"""Ops verbs for the workers' response caches: ``cache_purge`` and ``cache_bump``.

Both are pushed to every live worker over the control channel and answered
with each worker's Ack (per slot: pid, generation, ok, detail), so the CLI
can say exactly which worker did not confirm.  ``cache_bump`` is a sticky
broadcast of the new version: workers started later (restarts, reload,
leak recycling) get it on Hello, and old entries can never be served again.
Registered on import (``numaserve.supervisor.ops`` imports this module).
"""

from __future__ import annotations

from typing import Any

from numaserve.supervisor.opsapi import OpsArgError, OpsTarget, arg_ack_timeout, verb

__all__ = ["CACHE_VERSION", "current_version"]

#: The sticky command (and its ``version`` argument) that carries the epoch.
CACHE_VERSION = "cache_version"
_ACK_TIMEOUT = 5.0


def current_version(sup: OpsTarget) -> int:
    """The cache epoch every worker is (or will be, on Hello) at; 0 before any bump."""
    return int(sup.channel.sticky.get(CACHE_VERSION, {}).get("version", 0))


def _summary(acks: dict[str, Any]) -> dict[str, Any]:
    failed = sorted(k for k, a in acks.items() if not a.get("ok"))
    return {"acks": acks, "workers": len(acks), "failed": failed, "ok": not failed}


@verb("cache_purge", mutating=True)
async def _cache_purge(sup: OpsTarget, args: dict[str, Any]) -> Any:
    prefix = args.get("prefix", "") or ""
    if not isinstance(prefix, str) or (prefix and not prefix.startswith("/")) or len(prefix) > 4096:
        raise OpsArgError(f"prefix {prefix!r}: expected a path prefix starting with /")
    timeout = arg_ack_timeout(args, "timeout", _ACK_TIMEOUT)
    acks = await sup.channel.broadcast("cache_purge", {"prefix": prefix}, timeout=timeout)
    return {"prefix": prefix, **_summary(acks), "result": f"purge {prefix or '(all)'}: {len(acks)} workers"}


@verb("cache_bump", mutating=True)
async def _cache_bump(sup: OpsTarget, args: dict[str, Any]) -> Any:
    timeout = arg_ack_timeout(args, "timeout", _ACK_TIMEOUT)
    version = current_version(sup) + 1
    acks = await sup.channel.broadcast(CACHE_VERSION, {"version": version}, timeout=timeout, sticky=True)
    return {"version": version, **_summary(acks), "result": f"cache version {version}: {len(acks)} workers"}


@verb("cache_version", mutating=False)
async def _cache_version(sup: OpsTarget, args: dict[str, Any]) -> Any:
    return {"version": current_version(sup)}
