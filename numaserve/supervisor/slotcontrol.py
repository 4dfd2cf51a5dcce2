"""The narrow interfaces through which helpers act on the supervisor's slots.

Operations, the leak watch, the limits manager, the stop sequence, the
command probe and the ops handlers never see the ``Supervisor`` class: they
get the slot table (``SlotControl``: the one writer of slot state), the
worker channel (``WorkerChannel``) and the routing (``Routing``): in
production ``slottable.SlotTable``, ``channel.WorkerChannel`` and
``routing.Router``, in unit tests one fake that is all three.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterable, Mapping, Protocol, Sequence

from numaserve.config import Config
from numaserve.supervisor.slots import SlotState, WorkerProc

__all__ = ["Routing", "SlotControl", "WorkerChannel"]


class WorkerChannel(Protocol):
    """Commands to workers over the control channel (Acks awaited or fire-and-forget)."""

    async def broadcast(self, name: str, args: dict[str, Any], *, timeout: float = 5.0,
                        sticky: bool = False) -> dict[str, Any]: ...

    async def broadcast_one(self, w: WorkerProc, name: str, args: dict[str, Any], *,
                            timeout: float = 5.0) -> dict[str, Any]: ...

    async def command_each(self, targets: Sequence[tuple[int, WorkerProc, dict[str, Any]]], name: str, *,
                           timeout: float = 5.0) -> list[dict[str, Any]]: ...

    def send_command(self, w: WorkerProc, name: str, args: dict[str, Any]) -> None: ...


class Routing(Protocol):
    """Where new connections go: the slots that serve now."""

    def steer(self) -> None:
        """Re-point new connections at the slots that serve now."""

    def healthy_slots(self) -> list[int]: ...

    def queued(self, slots: Iterable[int]) -> int:
        """Connections waiting in these slots' listeners."""


class SlotControl(Protocol):
    """The slot table's verbs (``slottable.SlotTable``): the only way to change a slot's state."""

    cfg: Config
    stopping: bool
    wake: asyncio.Event                 # set it to run the supervision loop now

    @property
    def slots(self) -> Mapping[int, SlotState]: ...

    def start_worker(self, slot: SlotState, now: float) -> None:
        """Spawn the slot's worker (state STARTING, or BACKOFF/FAILED if the spawn fails)."""

    def start_fresh(self, slot: SlotState, now: float) -> WorkerProc | None:
        """Nothing serves: start the slot now, crash history forgotten (None: the spawn failed)."""

    def start_incoming(self, slot: SlotState, now: float) -> WorkerProc:
        """The slot's next generation beside the serving one (raises OSError/NumaserveError)."""

    def promote(self, slot: SlotState, now: float, why: str) -> WorkerProc:
        """The Ready incoming worker serves; returns the old one (retiring)."""

    def retire(self, slot: SlotState, w: WorkerProc, now: float, deadline: float) -> None:
        """Tell one worker to drain within ``deadline`` s and exit."""

    def abort(self, w: WorkerProc, reason: str, now: float) -> None:
        """SIGKILL one worker for ``reason`` (the reaper accounts for its exit)."""

    def claim(self, slot: SlotState, op_id: str) -> None: ...

    def release(self, slot: SlotState, op_id: str) -> None: ...

    def note_restart_reason(self, slot: SlotState, reason: str) -> None: ...

    def begin_drain(self, slot: SlotState) -> None: ...

    def end_drain(self, slot: SlotState) -> None: ...

    def undrain(self, slot: SlotState, now: float) -> WorkerProc | None: ...
