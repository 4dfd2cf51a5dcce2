"""The narrow interfaces through which helpers act on the supervisor's slots.

Operations, the leak watch, the limits manager and the ops handlers never see
the ``Supervisor`` class: they get an object that satisfies one of these
protocols (the supervisor in production, a fake in unit tests).  Slot state
*changes* that involve a process (start, next generation, ready, drain, kill,
steer) go through these verbs, so the supervisor keeps its bookkeeping
(logs, restart accounting, steering) in one place.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable, Mapping, Protocol, Sequence

from numaserve.config import Config
from numaserve.supervisor.slots import SlotState, WorkerProc

__all__ = ["SlotControl", "WorkerChannel"]


class WorkerChannel(Protocol):
    """Commands to workers over the control channel (Acks awaited or fire-and-forget)."""

    async def broadcast(self, name: str, args: dict[str, Any], *, timeout: float = 5.0,
                        sticky: bool = False) -> dict[str, Any]: ...

    async def broadcast_one(self, w: WorkerProc, name: str, args: dict[str, Any], *,
                            timeout: float = 5.0) -> dict[str, Any]: ...

    async def command_each(self, targets: Sequence[tuple[int, WorkerProc, dict[str, Any]]], name: str, *,
                           timeout: float = 5.0) -> list[dict[str, Any]]: ...

    def send_command(self, w: WorkerProc, name: str, args: dict[str, Any]) -> None: ...


class SlotControl(WorkerChannel, Protocol):
    """What operations, the leak watch and the limits manager may do to slots."""

    cfg: Config
    stopping: bool
    wake: asyncio.Event                 # set it to run the supervision loop now

    @property
    def slots(self) -> Mapping[int, SlotState]: ...

    def start_worker(self, slot: SlotState, now: float) -> None:
        """Spawn the slot's worker (state STARTING, or BACKOFF/FAILED if the spawn fails)."""

    def spawn_generation(self, slot: SlotState, now: float) -> WorkerProc:
        """Start the slot's next generation beside the current one (raises OSError/NumaserveError)."""

    def mark_ready(self, slot: SlotState, now: float) -> None:
        """The slot's current worker serves: READY, crash history of a retried slot forgotten."""

    def send_stop(self, slot: SlotState, w: WorkerProc, now: float, deadline: float, *, drain: bool) -> None:
        """Ask one worker to finish within ``deadline`` s and exit (Drain or Stop; SIGTERM without a channel)."""

    def kill(self, w: WorkerProc, now: float) -> None:
        """SIGKILL one worker (the reaper accounts for its exit)."""

    def steer(self) -> None:
        """Re-point new connections at the slots that serve now."""

    def healthy_slots(self) -> list[int]: ...

    def queued(self, slots: Iterable[int]) -> int:
        """Connections waiting in these slots' listeners."""
