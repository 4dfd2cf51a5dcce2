"""The ops verb registry, argument checks (the slots the args name included), and what a verb may touch.

Handlers (``ops.py``, ``ops_cache.py``) register with ``@verb`` and receive an
``OpsTarget``: the supervisor in production, a fake in unit tests.  They never
import the supervisor class.
"""

from __future__ import annotations

import math
from typing import Any, Awaitable, Callable, Protocol

from numaserve.control.opsargs import (  # the one table of ranges, shared with the CLI
    ACK_TIMEOUT,
    MAX_ACK_TIMEOUT_S,
    MAX_RATE,
    MAX_TIMEOUT_S,
    RATE,
    TIMEOUT,
    NumberRange,
)
from numaserve.errors import NumaserveError
from numaserve.supervisor.audit import AuditLog
from numaserve.supervisor.limits import LimitsManager
from numaserve.supervisor.operations import Operation, Operations
from numaserve.supervisor.slotcontrol import SlotControl, WorkerChannel


class OpsChannel(WorkerChannel, Protocol):
    """The worker channel as the ops verbs see it: commands, and the sticky ones new workers get on Hello."""

    sticky: dict[str, dict[str, Any]]


class ReloadStarter(Protocol):
    def start(self, args: dict[str, Any]) -> Operation:
        """Re-read the config and roll every slot onto it (a tracked ``reload`` operation)."""


class OpsTarget(Protocol):
    """What the ops verbs read and start: the slot table, the worker channel, operations, limits,
    the audit log, reload, status and stop (the supervisor in production, a fake in unit tests)."""

    state: str
    table: SlotControl
    channel: OpsChannel
    operations: Operations
    limits: LimitsManager
    audit: AuditLog
    reloader: ReloadStarter

    def status(self) -> dict[str, Any]: ...

    def request_stop(self, reason: str, fast: bool = False) -> None: ...


Handler = Callable[["OpsTarget", dict[str, Any]], Awaitable[Any]]
READ_ONLY: dict[str, Handler] = {}
MUTATING: dict[str, Handler] = {}


class OpsArgError(NumaserveError):
    """Bad arguments in an ops request (reported to the client, not raised)."""


def verb(name: str, *, mutating: bool) -> Callable[[Handler], Handler]:
    def deco(fn: Handler) -> Handler:
        (MUTATING if mutating else READ_ONLY)[name] = fn
        return fn

    return deco


def arg_int(args: dict[str, Any], name: str, *, required: bool = False, minimum: int = 0,
            maximum: int = 1 << 31) -> int | None:
    v = args.get(name)
    if v is None:
        if required:
            raise OpsArgError(f"missing argument {name!r}")
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= maximum:
        raise OpsArgError(f"argument {name!r} = {v!r}: expected an integer in {minimum}..{maximum}")
    return v


def arg_range(args: dict[str, Any], name: str, rng: NumberRange) -> float | None:
    """``args[name]`` checked against ``rng`` (None when absent): the one checker of ops numbers."""
    v = args.get(name)
    if v is None:
        return None
    try:
        return rng.check(f"argument {name!r}", v)
    except ValueError as e:
        raise OpsArgError(str(e)) from None


def arg_number(args: dict[str, Any], name: str, *, minimum: float, maximum: float,
               exclusive_min: bool = False, unit: str = "") -> float | None:
    """A finite number in range (NaN and infinities refused: a NaN deadline never expires)."""
    v = args.get(name)
    if v is None:
        return None
    low_ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and (
        v > minimum if exclusive_min else v >= minimum)
    if not low_ok or v > maximum:
        bound = f"> {minimum:g}" if exclusive_min else f">= {minimum:g}"
        raise OpsArgError(f"argument {name!r} = {v!r}: expected a finite number {bound} and <= {maximum:g}{unit}")
    return float(v)


def arg_timeout(args: dict[str, Any], name: str, default: float | None) -> float | None:
    v = arg_range(args, name, TIMEOUT)
    return default if v is None else v


def arg_ack_timeout(args: dict[str, Any], name: str, default: float) -> float:
    """How long to wait for the workers' acknowledgement: at most MAX_ACK_TIMEOUT_S."""
    v = arg_range(args, name, ACK_TIMEOUT)
    return default if v is None else v


def arg_rate(args: dict[str, Any], name: str) -> float | None:
    """A request rate (per second) a limiter can act on: MIN_RATE .. MAX_RATE."""
    return arg_range(args, name, RATE)


def arg_bool(args: dict[str, Any], name: str, default: bool = False) -> bool:
    v = args.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise OpsArgError(f"argument {name!r} = {v!r}: expected true or false")
    return v


def arg_float(args: dict[str, Any], name: str, default: float) -> float:
    """A timeout-like argument: finite, >= 0, at most MAX_TIMEOUT_S."""
    v = arg_timeout(args, name, default)
    assert v is not None
    return v


def select_slots(sup: OpsTarget, args: dict[str, Any], *, allow_all: bool = False) -> list[Any]:
    """Slots named by ``slot`` or ``node`` (or every slot with ``all``)."""
    slot = arg_int(args, "slot")
    node = arg_int(args, "node")
    if slot is not None and node is not None:
        raise OpsArgError("give --slot or --node, not both")
    if slot is not None:
        if slot not in sup.table.slots:
            raise OpsArgError(f"no slot {slot}; slots: {', '.join(str(s) for s in sup.table.slots)}")
        return [sup.table.slots[slot]]
    if node is not None:
        chosen = [s for s in sup.table.slots.values() if s.plan.node == node]
        if not chosen:
            nodes = sorted({s.plan.node for s in sup.table.slots.values()})
            raise OpsArgError(f"no slot on node {node}; nodes with slots: {', '.join(map(str, nodes))}")
        return chosen
    if allow_all or arg_bool(args, "all"):
        return list(sup.table.slots.values())
    raise OpsArgError("name the slots: --slot S or --node N")
