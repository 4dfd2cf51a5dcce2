"""Ops requests from the CLI: verb → handler.

Read-only verbs never change state; mutating verbs are logged (and audited
by the ops-security work). Unknown verbs get an error reply, never an
exception in the supervisor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable

import structlog

from numaserve.control.messages import OpsReply, OpsRequest

if TYPE_CHECKING:
    from numaserve.supervisor.arbiter import Supervisor

log = structlog.get_logger("numaserve.ops")

Handler = Callable[["Supervisor", dict[str, Any]], Awaitable[Any]]
READ_ONLY: dict[str, Handler] = {}
MUTATING: dict[str, Handler] = {}


def verb(name: str, *, mutating: bool) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        (MUTATING if mutating else READ_ONLY)[name] = fn
        return fn

    return deco


@verb("ping", mutating=False)
async def _ping(sup: "Supervisor", args: dict[str, Any]) -> Any:
    return {"pong": True, "state": sup.state}


@verb("status", mutating=False)
async def _status(sup: "Supervisor", args: dict[str, Any]) -> Any:
    return sup.status()


@verb("stop", mutating=True)
async def _stop(sup: "Supervisor", args: dict[str, Any]) -> Any:
    fast = bool(args.get("fast", False))
    sup.request_stop("ops stop" + (" (fast)" if fast else ""), fast=fast)
    return {"stopping": True, "fast": fast}


async def handle_ops_request(sup: "Supervisor", req: OpsRequest) -> OpsReply:
    handler = READ_ONLY.get(req.verb) or MUTATING.get(req.verb)
    if handler is None:
        known = ", ".join(sorted(READ_ONLY | MUTATING))
        return OpsReply(ok=False, id=req.id, error=f"unknown verb {req.verb!r}: expected one of {known}")
    if not isinstance(req.args, dict):
        return OpsReply(ok=False, id=req.id, error="args must be a map")
    if req.verb in MUTATING:
        log.info("ops_command", verb=req.verb, args=req.args, id=req.id)
    result = await handler(sup, req.args)
    return OpsReply(ok=True, id=req.id, result=result)
