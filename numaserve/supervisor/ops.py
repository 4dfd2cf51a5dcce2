"""Ops requests from the CLI: verb → handler.

Read-only verbs (status, ...) are served on every ops socket, including the
read-only one; mutating verbs only on the owner's socket (and CURVE TCP), and
every mutating request is written to the audit log with who asked, what, and
how it ended.  Unknown verbs and bad arguments get an error reply, never an
exception in the supervisor.  A verb that starts an operation returns the
``Operation``: the handler renders it and audits how it ends.
"""

from __future__ import annotations

import time
from typing import Any

import structlog

from numaserve.control.messages import OpsReply, OpsRequest
from numaserve.errors import NumaserveError
from numaserve.supervisor.operations import Operation
from numaserve.supervisor.opsapi import (  # noqa: F401  (re-exported: the verbs' helpers)
    MAX_RATE,
    MAX_TIMEOUT_S,
    MUTATING,
    READ_ONLY,
    Handler,
    OpsArgError,
    OpsTarget,
    arg_bool,
    arg_float,
    arg_int,
    arg_number,
    arg_rate,
    arg_ack_timeout,
    arg_timeout,
    select_slots,
    verb,
)

log = structlog.get_logger("numaserve.ops")


@verb("ping", mutating=False)
async def _ping(sup: OpsTarget, args: dict[str, Any]) -> Any:
    return {"pong": True, "state": sup.state}


@verb("status", mutating=False)
async def _status(sup: OpsTarget, args: dict[str, Any]) -> Any:
    return sup.status()


@verb("stop", mutating=True)
async def _stop(sup: OpsTarget, args: dict[str, Any]) -> Any:
    fast = arg_bool(args, "fast")
    sup.request_stop("ops stop" + (" (fast)" if fast else ""), fast=fast)
    return {"stopping": True, "fast": fast}


def _summary(result: Any) -> str:
    if isinstance(result, dict):
        for key in ("state", "result", "message"):
            if key in result:
                return str(result[key])
    return "ok"


async def handle_ops_request(
    sup: OpsTarget, req: OpsRequest, *, channel: str = "ipc", readonly: bool = False,
    who: dict[str, Any] | None = None,
) -> OpsReply:
    who = who if who is not None else {}
    if not isinstance(req.verb, str) or not req.verb:
        return OpsReply(ok=False, id=req.id, error="missing verb")
    handler = READ_ONLY.get(req.verb) or MUTATING.get(req.verb)
    if handler is None:
        known = ", ".join(sorted(READ_ONLY | MUTATING))
        return OpsReply(ok=False, id=req.id, error=f"unknown verb {req.verb!r}: expected one of {known}")
    if not isinstance(req.args, dict):
        return OpsReply(ok=False, id=req.id, error="args must be a map")
    mutating = req.verb in MUTATING

    def audit(ok: bool, result: str) -> None:
        sup.audit.record(who=who, channel=channel, verb=req.verb, args=req.args, op_id=req.id, ok=ok, result=result)

    if mutating and readonly:
        audit(False, "refused: read-only socket")
        return OpsReply(ok=False, id=req.id,
                        error=f"{req.verb!r} changes the service: not allowed on the read-only socket")
    op: Operation | None = None   # the operation the verb started, if it started one
    try:
        result = await handler(sup, req.args)
        if isinstance(result, Operation):
            op, result = result, _op_reply(result)
    except OpsArgError as e:
        reply = OpsReply(ok=False, id=req.id, error=str(e))
    except NumaserveError as e:
        reply = OpsReply(ok=False, id=req.id, error=str(e))
    except Exception as e:  # a bug in a handler must not take the supervisor down
        log.exception("ops_handler_error", verb=req.verb)
        reply = OpsReply(ok=False, id=req.id, error=f"internal error: {type(e).__name__}: {e}")
    else:
        reply = OpsReply(ok=True, id=req.id, result=result)
    if mutating:
        audit(reply.ok, reply.error if not reply.ok else _summary(reply.result))
        if op is not None:
            # the request was accepted; record how the operation it started ended
            op.on_finish.append(lambda o: audit(o.state == "succeeded", f"operation {o.id} {o.state}: {o.result}"))
    return reply


# ------------------------------------------------------------------ operations


def _op_reply(op: Operation) -> dict[str, Any]:
    """How a started operation is shown in the reply (verbs return the ``Operation``; the handler renders it)."""
    return {"operation": op.to_json(), "state": op.state}


@verb("drain", mutating=True)
async def _drain(sup: OpsTarget, args: dict[str, Any]) -> Any:
    slots = select_slots(sup, args)
    timeout = arg_float(args, "timeout", sup.table.cfg.server.graceful_timeout)
    return sup.operations.drain(args, slots, timeout)


@verb("undrain", mutating=True)
async def _undrain(sup: OpsTarget, args: dict[str, Any]) -> Any:
    slots = select_slots(sup, args, allow_all=True)
    return sup.operations.undrain(args, slots)


@verb("restart", mutating=True)
async def _restart(sup: OpsTarget, args: dict[str, Any]) -> Any:
    slots = select_slots(sup, args)
    timeout = arg_float(args, "timeout", sup.table.cfg.server.graceful_timeout)
    return sup.operations.restart(args, slots, timeout)


@verb("reload", mutating=True)
async def _reload(sup: OpsTarget, args: dict[str, Any]) -> Any:
    return sup.reloader.start(args)


@verb("operation", mutating=False)
async def _operation(sup: OpsTarget, args: dict[str, Any]) -> Any:
    op_id = args.get("id")
    if op_id is not None and not isinstance(op_id, str):
        raise OpsArgError(f"argument 'id' = {op_id!r}: expected an operation id (text)")
    if not op_id:
        return {"operations": sup.operations.recent()}
    op = sup.operations.get(str(op_id))
    if op is None:
        raise OpsArgError(f"no operation {op_id!r} (the supervisor keeps the last 32)")
    return {"operation": op.to_json(), "state": op.state}


# ------------------------------------------------------------------ ratelimit


@verb("ratelimit_show", mutating=False)
async def _ratelimit_show(sup: OpsTarget, args: dict[str, Any]) -> Any:
    return {
        "mode": sup.limits.mode,
        "nodes": {str(n): d for n, d in sup.limits.last_decision.items()},
        "slots": [{"slot": s.plan.slot, "node": s.plan.node, **sup.limits.status(s)} for s in sup.table.slots.values()],
    }


@verb("ratelimit_set", mutating=True)
async def _ratelimit_set(sup: OpsTarget, args: dict[str, Any]) -> Any:
    conc = arg_int(args, "concurrency", minimum=1, maximum=1 << 20)
    rate = arg_rate(args, "rate")
    if conc is None and rate is None:
        raise OpsArgError("give a concurrency (e.g. 32) or a rate (e.g. 200/s)")
    if sup.limits.mode == "off":
        raise OpsArgError("limits.mode is \"off\": enable a mode in the config to push limits")
    node = arg_int(args, "node")
    slots = select_slots(sup, args) if node is None else []
    if node is not None and node not in sup.limits.loops:
        raise OpsArgError(f"no slot on node {node}")
    touched = sup.limits.override([s.plan.slot for s in slots], node, conc, None if rate is None else float(rate),
                                  push=False)
    t0 = time.perf_counter()
    acks = await sup.limits.push_acked(touched)   # every worker applied it when this returns
    acked_in_ms = round(1000.0 * (time.perf_counter() - t0), 2)
    return {"state": "applied" if all(a.get("ok") for a in acks.values()) else "partly applied", "acks": acks,
            "acked_in_ms": acked_in_ms,   # first Command sent -> last Ack read (the fan-out, not this reply)
            "slots": [sup.limits.status(s) | {"slot": s.plan.slot} for s in sup.table.slots.values()]}


@verb("ratelimit_auto", mutating=True)
async def _ratelimit_auto(sup: OpsTarget, args: dict[str, Any]) -> Any:
    node = arg_int(args, "node")
    if node is not None and node not in sup.limits.loops:
        raise OpsArgError(f"no slot on node {node}")
    slot = arg_int(args, "slot")
    if slot is not None and slot not in sup.table.slots:
        raise OpsArgError(f"no slot {slot}")
    touched = sup.limits.auto(None if slot is None and node is None else ([slot] if slot is not None else []), node,
                              push=False)
    t0 = time.perf_counter()
    acks = await sup.limits.push_acked(touched)
    return {"state": "auto", "acks": acks, "acked_in_ms": round(1000.0 * (time.perf_counter() - t0), 2)}


from numaserve.supervisor import ops_cache  # noqa: E402,F401  (registers the cache verbs)
