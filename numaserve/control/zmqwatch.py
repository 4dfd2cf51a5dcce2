"""Waiting for a message on a libzmq socket without pyzmq's asyncio layer.

Both ends of the control channel (the supervisor's ROUTER, each worker's
DEALER) send and receive with direct non-blocking libzmq calls and watch the
socket's fd only while they wait: pyzmq's asyncio socket keeps a reader on
that fd for good and wakes the loop for every completed send.

libzmq's fd is edge-triggered: reading ``EVENTS`` (and every send or
receive) processes what its I/O thread signalled.  So ``wait`` checks
``EVENTS`` before it watches the fd (a message that comes after the check
makes the fd readable again), and whoever sends on the socket while a wait is
pending calls ``recheck``: that send may have taken the edge of a message
that came meanwhile.
"""

from __future__ import annotations

import asyncio

import zmq

__all__ = ["ReadWatch", "wake"]


def wake(fut: asyncio.Future[None] | None) -> None:
    """Resolve ``fut`` unless it is None or already done (a loop callback; never raises)."""
    if fut is not None and not fut.done():
        fut.set_result(None)


class ReadWatch:
    """One pending wait for readability of one socket at a time."""

    def __init__(self) -> None:
        self._fut: asyncio.Future[None] | None = None

    @property
    def waiting(self) -> bool:
        return self._fut is not None

    async def wait(self, sock: zmq.Socket) -> None:
        """Until a message may be queued on ``sock`` (or ``release``): the fd is watched only meanwhile."""
        if sock.get(zmq.EVENTS) & zmq.POLLIN:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        fd = sock.get(zmq.FD)
        loop.add_reader(fd, wake, fut)
        self._fut = fut
        try:
            await fut
        finally:
            self._fut = None
            loop.remove_reader(fd)

    def recheck(self, sock: zmq.Socket) -> None:
        """After a send (or a read outside the waiter) on ``sock``: end a pending wait if a message is queued."""
        fut = self._fut
        if fut is not None and not fut.done() and sock.get(zmq.EVENTS) & zmq.POLLIN:
            fut.set_result(None)

    def release(self) -> None:
        """End a pending wait now (the waiter decides what to do next)."""
        wake(self._fut)
