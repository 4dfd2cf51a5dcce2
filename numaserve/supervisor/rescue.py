"""Connections stranded on a slot that cannot serve them are handed on.

Steering keeps *new* connections off a slot the moment it stops serving, but
what already waits in that slot's accept queue stays there: fine when a
replacement is about to start (it accepts them from the same socket), not
when the slot failed, backs off, or its worker is frozen.  Closing the
listener would reset them (``tcp_migrate_req`` is off by default and needs
root), so the supervisor takes them off the queue itself and relays each one,
byte for byte, to a serving slot through the same listener group: it
connects to the bind address and the steering program routes that
connection to a healthy slot.  Protocol-agnostic (HTTP, TLS, websockets);
the app sees the supervisor's loopback address as the peer of those few
connections.

A relay ends when both directions have ended (a client that keeps its side
open after the server's answer ended gets ``linger`` seconds); at most
``max_relays`` run at once (beyond that the rest wait in the queue, as they
would without us).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Iterable

import structlog

from numaserve.net.listeners import Listener

log = structlog.get_logger("numaserve.supervisor")

__all__ = ["Rescuer", "connect_address"]

_CHUNK = 65536


def connect_address(lst: Listener) -> tuple[str, int]:
    """Where a local client reaches this listener's group: wildcards → loopback."""
    if lst.family == socket.AF_INET6:
        return ("::1" if lst.host in ("::", "") else lst.host), lst.port
    return ("127.0.0.1" if lst.host in ("0.0.0.0", "") else lst.host), lst.port


class Rescuer:
    def __init__(self, *, max_relays: int = 512, per_tick: int = 256, linger: float = 30.0) -> None:
        self.max_relays = max_relays
        self.linger = linger
        self.per_tick = per_tick
        self.active: set[asyncio.Task[None]] = set()
        self.rescued = 0
        self.failed = 0

    def tick(self, stranded: Iterable[tuple[int, Listener]]) -> int:
        """Take what waits on these (slot, listener) queues; returns how many were taken."""
        taken = 0
        for slot, lst in stranded:
            while taken < self.per_tick and len(self.active) < self.max_relays:
                try:
                    conn, _peer = lst.sock.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as e:
                    log.warning("rescue_accept_failed", slot=slot, address=lst.address, error=str(e))
                    break
                taken += 1
                self.rescued += 1
                conn.setblocking(False)
                task = asyncio.get_running_loop().create_task(self._relay(conn, connect_address(lst), slot))
                self.active.add(task)
                task.add_done_callback(self.active.discard)
        if taken:
            log.info("connections_rescued", count=taken, slots=sorted({s for s, _ in stranded}),
                     total=self.rescued)
        return taken

    async def _relay(self, conn: socket.socket, target: tuple[str, int], slot: int) -> None:
        cw: asyncio.StreamWriter | None = None
        uw: asyncio.StreamWriter | None = None
        try:
            cr, cw = await asyncio.open_connection(sock=conn)
            try:
                ur, uw = await asyncio.wait_for(asyncio.open_connection(*target), 5.0)
            except (OSError, asyncio.TimeoutError) as e:
                self.failed += 1
                log.warning("rescue_connect_failed", slot=slot, target=f"{target[0]}:{target[1]}", error=str(e))
                return
            up = asyncio.ensure_future(self._pump(cr, uw))
            down = asyncio.ensure_future(self._pump(ur, cw))
            try:
                # the server's answer decides: once it is complete, a client
                # that never closes gets ``linger`` seconds, not forever
                await down
                await asyncio.wait_for(up, self.linger)
            except asyncio.TimeoutError:
                pass
            finally:
                for t in (up, down):
                    t.cancel()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (cw, uw):
                if w is not None:
                    w.close()
            if cw is None:
                conn.close()

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await src.read(_CHUNK)
                if not data:
                    break
                dst.write(data)
                await dst.drain()
            if dst.can_write_eof():
                dst.write_eof()
        except (OSError, RuntimeError):
            dst.close()

    async def close(self) -> None:
        for t in list(self.active):
            t.cancel()
        if self.active:
            await asyncio.gather(*self.active, return_exceptions=True)

    def status(self) -> dict[str, int]:
        return {"rescued": self.rescued, "relaying": len(self.active), "relay_failures": self.failed}
