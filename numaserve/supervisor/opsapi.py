"""The ops verb registry, argument checks, and what a verb may touch.

Handlers (``ops.py``, ``ops_cache.py``) register with ``@verb`` and receive an
``OpsTarget``: the supervisor in production, a fake in unit tests.  They never
import the supervisor class.
"""

from __future__ import annotations

import math
from typing import Any, Awaitable, Callable, Protocol

from numaserve.errors import NumaserveError
from numaserve.supervisor.audit import AuditLog
from numaserve.supervisor.limits import LimitsManager
from numaserve.supervisor.operations import Operation, Operations
from numaserve.supervisor.slotcontrol import SlotControl


class OpsTarget(SlotControl, Protocol):
    """What the ops verbs read and start: status, operations, limits, reload, stop."""

    state: str
    sticky: dict[str, dict[str, Any]]
    operations: Operations
    limits: LimitsManager
    audit: AuditLog

    def status(self) -> dict[str, Any]: ...

    def request_stop(self, reason: str, fast: bool = False) -> None: ...

    def start_reload(self, args: dict[str, Any]) -> Operation: ...


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


#: Longest timeout an ops request may ask for (a week): past that it is a typo, not a plan.
MAX_TIMEOUT_S = 7 * 86400.0
MAX_RATE = 1e9


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
    v = arg_number(args, name, minimum=0.0, maximum=MAX_TIMEOUT_S, unit=" seconds")
    return default if v is None else v


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
