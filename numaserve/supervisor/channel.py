"""The supervisor's end of the worker control channel: transport only.

One ZeroMQ ROUTER socket; every decoded message goes to a callback
(``WorkerMessages.handle_worker_msg``: the supervisor decides what it means).
Out: commands to one worker or to all, each matched with its Ack by
(command id, slot, generation).  ``sticky`` commands are replayed to every
worker that says Hello later, so a setting with an epoch reaches new workers.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Mapping

import zmq
import zmq.asyncio

from numaserve.control import messages as m
from numaserve.supervisor import controlplane as cp
from numaserve.supervisor import slots as S

__all__ = ["WorkerChannel"]


class WorkerChannel:
    def __init__(self, slots: Mapping[int, S.SlotState]) -> None:
        self.slots = slots
        self.sock: zmq.asyncio.Socket | None = None     # bound by the supervisor's open()
        self._acks: dict[tuple[str, int, int], asyncio.Future[m.Ack]] = {}
        # settings every worker must have (cache version, limits ...): replayed to
        # each new worker right after its Hello, so it starts at the current epoch
        self.sticky: dict[str, dict[str, Any]] = {}

    async def serve(self, handler: cp.WorkerMessages) -> None:
        assert self.sock is not None
        await cp.serve_control(handler, self.sock)

    def resolve(self, ack: m.Ack) -> None:
        """An Ack arrived: wake whoever waits for it (late or unknown Acks are dropped)."""
        fut = self._acks.pop((ack.ref, ack.slot, ack.generation), None)
        if fut is not None and not fut.done():
            fut.set_result(ack)

    def send_soon(self, w: S.WorkerProc, msg: m.Msg) -> None:
        asyncio.get_running_loop().create_task(self._send(w, msg))

    def replay_sticky(self, w: S.WorkerProc) -> None:
        for name, args in self.sticky.items():
            self.send_soon(w, m.Command(id=f"sticky-{name}-{uuid.uuid4().hex[:6]}", name=name, args=args))

    async def _send(self, w: S.WorkerProc, msg: m.Msg) -> bool:
        if w.identity is None or self.sock is None:
            return False
        try:
            await self.sock.send_multipart([w.identity, m.encode(msg)], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    async def broadcast_one(self, w: S.WorkerProc, name: str, args: dict[str, Any], *,
                            timeout: float = 5.0) -> dict[str, Any]:
        """Send one named command to one worker and wait for its Ack."""
        slot = next(s for s in self.slots.values() if any(x is w for x in s.workers()))
        cid = uuid.uuid4().hex[:12]
        fut: asyncio.Future[m.Ack] = asyncio.get_running_loop().create_future()
        self._acks[(cid, slot.plan.slot, w.generation)] = fut
        await self._send(w, m.Command(id=cid, name=name, args=args))
        try:
            ack = await asyncio.wait_for(fut, timeout)
            return {"ok": ack.ok, "detail": ack.detail}
        except asyncio.TimeoutError:
            return {"ok": False, "detail": f"no ack within {timeout:g}s"}
        finally:
            self._acks.pop((cid, slot.plan.slot, w.generation), None)

    def send_command(self, w: S.WorkerProc, name: str, args: dict[str, Any]) -> None:
        """Fire-and-forget named command to one worker (its Ack is logged)."""
        if w.identity is None or w.external or w.popen.poll() is not None:
            return
        cmd = m.Command(id=f"{name}-{uuid.uuid4().hex[:8]}", name=name, args=args)
        asyncio.get_running_loop().create_task(self._send(w, cmd))

    async def broadcast(self, name: str, args: dict[str, Any], *, timeout: float = 5.0,
                        sticky: bool = False) -> dict[str, Any]:
        """Send ``Command(name, args)`` to every live worker and wait for each Ack.

        ``sticky``: remember it so workers started later get it too (settings
        with an epoch). Returns per slot: pid, generation, ok, detail; a worker
        that does not answer within ``timeout`` is reported, not waited for.
        """
        if sticky:
            self.sticky[name] = dict(args)
        cid = uuid.uuid4().hex[:12]
        loop = asyncio.get_running_loop()
        waits: list[tuple[S.SlotState, S.WorkerProc, asyncio.Future[m.Ack]]] = []
        for slot in self.slots.values():
            for w in (slot.worker, slot.incoming):
                if w is None or w.identity is None or w.external or w.popen.poll() is not None:
                    continue
                fut: asyncio.Future[m.Ack] = loop.create_future()
                self._acks[(cid, slot.plan.slot, w.generation)] = fut
                await self._send(w, m.Command(id=cid, name=name, args=args))
                waits.append((slot, w, fut))
        results: dict[str, Any] = {}
        if waits:
            await asyncio.wait([f for _, _, f in waits], timeout=timeout)
        for slot, w, fut in waits:
            self._acks.pop((cid, slot.plan.slot, w.generation), None)
            key = str(slot.plan.slot) if w is slot.worker else f"{slot.plan.slot}/incoming"
            if fut.done():
                ack = fut.result()
                results[key] = {"pid": w.pid, "generation": w.generation, "ok": ack.ok, "detail": ack.detail}
            else:
                fut.cancel()
                results[key] = {"pid": w.pid, "generation": w.generation, "ok": False,
                                "detail": f"no ack within {timeout:g}s"}
        return results
