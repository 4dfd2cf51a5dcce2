"""Single-purpose configurations of the worker's one edge layer (``numaserve.worker.edge``).

The worker itself runs one ``Edge`` with everything on; these names give
the same layer with one job each, for embedding numaserve's edge in another
server or testing one behaviour alone:

* ``MetricsMiddleware(app, stats)``: request counts, status classes,
  latency, ``Connection: close`` while draining, lifespan failure record;
* ``BodyLimitMiddleware(app, max_body_bytes, read_timeout, stats)``: 413 /
  408 at the edge (counted in ``stats``' ``rejected_*``, requests not counted).

Only ``http`` scopes are touched; ``websocket`` passes straight through.
"""

from __future__ import annotations

from numaserve.worker.asgi_types import ASGIApp
from numaserve.worker.edge import LINGER_BYTES, LINGER_S, Edge, LifespanRecord
from numaserve.worker.stats import WorkerStats

__all__ = [
    "LINGER_BYTES",
    "LINGER_S",
    "ASGIApp",
    "BodyLimitMiddleware",
    "LifespanRecord",
    "MetricsMiddleware",
]


class MetricsMiddleware(Edge):
    """The edge with metrics only."""

    def __init__(self, app: ASGIApp, stats: WorkerStats, lifespan: LifespanRecord | None = None) -> None:
        super().__init__(app, stats=stats, lifespan=lifespan)


class BodyLimitMiddleware(Edge):
    """The edge with body limits only (413 over ``max_body_bytes``, 408 past ``read_timeout``)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, read_timeout: float,
                 stats: WorkerStats | None = None) -> None:
        super().__init__(app, max_body_bytes=max_body_bytes, read_timeout=read_timeout, limit_stats=stats)
