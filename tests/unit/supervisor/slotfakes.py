"""Processes and a slot table without processes: the supervisor's helpers under test.

``FakePopen`` is a worker that never ran; a test ends it with ``exit(code)``.
``FakeSlots`` is a real ``SlotTable`` whose spawns and messages are fake, and
also the ``Routing`` and ``WorkerChannel`` the helpers get; it records the
verbs that matter to an operation's order (``calls``).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Iterable

from numaserve.bind.placement import SlotPlan
from numaserve.config import Config
from numaserve.supervisor import slots as S
from numaserve.supervisor.backoff import RestartPolicy, RestartState
from numaserve.control import messages as m
from numaserve.supervisor.lifecycle import Lifecycle
from numaserve.supervisor.operations import Operation, Operations

_pids = itertools.count(40000)


class FakePopen:
    def __init__(self) -> None:
        self.pid = next(_pids)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode

    def exit(self, code: int) -> None:
        self.returncode = code


def plans(n: int, nodes: int = 1) -> list[SlotPlan]:
    return [SlotPlan(slot=i, node=i % nodes, index=i // nodes, cpus=(i,), mempolicy="local", memory_nodes=())
            for i in range(n)]


class FakeSlots(Lifecycle):
    """SlotControl + Routing + WorkerChannel for tests: a real slot table, fake processes, recorded verbs.

    ``auto_ready``: a spawned worker reports Ready on the next loop turn;
    ``exit_on_stop``: a worker told to stop exits (code 0) on the next loop turn.
    ``fail_spawn``: the next spawns raise OSError with this text.
    """

    def __init__(self, n: int = 2, *, cfg: Config | None = None, nodes: int = 1, policy: RestartPolicy | None = None,
                 auto_ready: bool = True, exit_on_stop: bool = True) -> None:
        policy = policy or RestartPolicy(initial=0.1, maximum=1.0, jitter=0.0, reset_after=60.0,
                                         loop_limit=3, loop_window=60.0, failed_retry=300.0)
        self.signals: list[tuple[int, int]] = []
        self.calls: list[tuple[Any, ...]] = []
        self.sent: list[tuple[int, str, dict[str, Any]]] = []   # (pid, command, args)
        self.acks: dict[str, dict[str, Any]] = {}               # command -> reply for broadcast_one
        self.auto_ready = auto_ready
        self.exit_on_stop = exit_on_stop
        self.fail_spawn: str | None = None
        self.depth = 0
        self.samples: dict[int, Any] = {}   # pid -> loadwatch.ProcSample the watchdog reads (none: gone)
        self.messages: list[tuple[int, m.Msg]] = []              # (pid, Drain/Stop) sent to workers
        slots = {p.slot: S.SlotState(plan=p, restart=RestartState(policy)) for p in plans(n, nodes)}
        super().__init__(cfg or Config(), slots, policy, spawn_worker=self._spawn, wake=asyncio.Event(), started=0.0,
                         send_message=lambda w, msg: self.messages.append((w.pid, msg)),
                         send_signal=lambda pid, sig: self.signals.append((pid, sig)),
                         oom_count=lambda: 0, frozen=lambda pid: False,
                         sample=self.samples.get, tree_sample=self.samples.get, cgroup_of=lambda pid: None)

    # the test's side ------------------------------------------------------

    def _spawn(self, cfg: Config, plan: SlotPlan, generation: int, now: float) -> S.WorkerProc:
        if self.fail_spawn:
            raise OSError(self.fail_spawn)
        w = S.WorkerProc(generation=generation, popen=FakePopen(), started=now)  # type: ignore[arg-type]
        w.identity = f"w{plan.slot}-{generation}".encode()
        w.hello = w.last_beat = now
        self.calls.append(("spawn", plan.slot, generation))
        if self.auto_ready:
            self._soon(lambda: self.on_ready(self.slots[plan.slot], w, now))
        return w

    def _soon(self, fn: Any) -> None:
        try:
            asyncio.get_running_loop().call_soon(fn)
        except RuntimeError:  # no loop: the test drives readiness itself
            pass

    def exit(self, w: S.WorkerProc, code: int, now: float = 0.0) -> None:
        """The process ends; the reaper accounts for it (as the supervision loop would)."""
        w.popen.exit(code)  # type: ignore[attr-defined]
        self.reap(now)

    # the slot table's verbs an operation's order is asserted on -----------------

    def start_worker(self, slot: S.SlotState, now: float) -> None:
        self.calls.append(("start_worker", slot.plan.slot))
        super().start_worker(slot, now)

    def mark_ready(self, slot: S.SlotState, now: float) -> None:
        self.calls.append(("mark_ready", slot.plan.slot))
        super().mark_ready(slot, now)

    def send_stop(self, slot: S.SlotState, w: S.WorkerProc, now: float, deadline: float, *, drain: bool) -> None:
        first = w.stop_sent is None
        super().send_stop(slot, w, now, deadline, drain=drain)
        if first:
            self.calls.append(("drain" if drain else "stop", slot.plan.slot, w.generation))
            if self.exit_on_stop:
                self._soon(lambda: self.exit(w, 0, now))

    def kill(self, w: S.WorkerProc, now: float) -> None:
        self.calls.append(("kill", w.generation))
        super().kill(w, now)

    # Routing ------------------------------------------------------------------

    def steer(self) -> None:
        self.calls.append(("steer", tuple(self.healthy_slots())))

    def healthy_slots(self) -> list[int]:
        return [s.plan.slot for s in self.slots.values() if s.state == S.READY and not s.drained]

    def queued(self, slots: Iterable[int]) -> int:
        list(slots)
        return self.depth

    async def broadcast(self, name: str, args: dict[str, Any], *, timeout: float = 5.0,
                        sticky: bool = False) -> dict[str, Any]:
        out = {}
        for s in self.slots.values():
            if s.worker is not None:
                self.sent.append((s.worker.pid, name, args))
                out[str(s.plan.slot)] = {"pid": s.worker.pid, "ok": True, "detail": ""}
        return out

    async def broadcast_one(self, w: S.WorkerProc, name: str, args: dict[str, Any], *,
                            timeout: float = 5.0) -> dict[str, Any]:
        self.sent.append((w.pid, name, args))
        return self.acks.get(name, {"ok": True, "detail": ""})

    async def command_each(self, targets: Any, name: str, *, timeout: float = 5.0) -> list[dict[str, Any]]:
        return [await self.broadcast_one(w, name, args, timeout=timeout) for _, w, args in targets]

    def send_command(self, w: S.WorkerProc, name: str, args: dict[str, Any]) -> None:
        self.sent.append((w.pid, name, args))


def held_operation(ops: Operations, slots: list[int], kind: str = "restart") -> tuple[Operation, asyncio.Event]:
    """A running operation that ends ("held") when the returned event is set (call inside a loop)."""
    gate = asyncio.Event()

    async def hold(op: Operation) -> str:
        await gate.wait()
        return "held"

    return ops.start(kind, {}, slots, hold), gate
