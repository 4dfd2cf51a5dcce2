"""Events and stats on the PUB stream (``events.sock``): topic frame, then JSON.

Every log event of the supervisor's own loggers is also published (a sink
on numaserve.log), so ``numaserve events`` sees what the journal sees.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

__all__ = ["EVENT_LOGGERS", "EventStream"]

EVENT_LOGGERS = ("numaserve.supervisor", "numaserve.operations", "numaserve.leak", "numaserve.limits",
                 "numaserve.steering", "numaserve.ops", "numaserve.audit")


class EventStream:
    def __init__(self) -> None:
        self.pub: zmq.asyncio.Socket | None = None    # bound by the supervisor's open()
        self._last_stats = 0.0

    def publish(self, event: str, *, topic: bytes = b"event", **fields: Any) -> None:
        """Events and stats on the PUB stream (``events.sock``): topic, then JSON."""
        if self.pub is None:
            return
        try:
            self.pub.send_multipart(
                [topic, msgspec.json.encode({"event": event, "ts": time.time(), **fields})],
                flags=zmq.NOBLOCK,
            )
        except zmq.ZMQError:
            pass

    EVENT_LOGGERS = ("numaserve.supervisor", "numaserve.operations", "numaserve.leak", "numaserve.limits",
                     "numaserve.steering", "numaserve.ops", "numaserve.audit")

    def sink(self, event: dict[str, Any]) -> None:
        if self.pub is None or event.get("logger") not in EVENT_LOGGERS:
            return
        try:
            self.pub.send_multipart([b"event", msgspec.json.encode(event, enc_hook=str)], flags=zmq.NOBLOCK)
        except (zmq.ZMQError, TypeError):
            pass

    def stats_due(self, now: float) -> bool:
        """At most one stats message a second."""
        if now - self._last_stats < 1.0:
            return False
        self._last_stats = now
        return True
