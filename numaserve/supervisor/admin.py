"""Admin HTTP endpoint of the supervisor: ``/metrics``, ``/healthz``, ``/readyz``.

Served by a small h11 server (``numaserve.supervisor.adminhttp``; not uvicorn,
whose import is ~2 MB of the supervisor's memory) *inside the supervisor's
asyncio loop* on a socket the supervisor binds before any worker starts (a
bad ``[admin] bind`` fails the start with a clear message, not a half-running
service).  No thread, no
process: a wedged loop stops answering here too, which is what an HTTP
prober should see.

* ``/healthz`` — 200 while the supervision loop ticks (its heartbeat is fresh)
  and the supervisor is not stopping; 503 otherwise.  "Alive" is the loop's
  heartbeat, not "the HTTP server answers": the server runs as another task
  and keeps answering when the main loop coroutine is stuck on an await.
* ``/readyz`` — 200 when every non-drained slot is ready; 200 with
  ``"status": "degraded"`` and the ``missing`` slots when the rest serve and
  the missing ones are ``failed`` (retried on a long backoff); 503 with the
  unready slots as JSON otherwise (a slot restarting, and from the first
  moment of a stop, so a load balancer takes the instance out during
  ``server.lb_grace``, before its workers drain).  Each request is noted
  (``sup.readyz_probes``): the grace is only spent when something watches
  readiness.
* ``/metrics`` — Prometheus text from a registry holding only our collector.

Any local user can connect, so every connection is bounded
(``ConnectionGuard``): at most ``ADMIN_MAX_CONNECTIONS`` (64, lowered to fit
the fd budget); at the cap the oldest idle connection is closed to admit the
new one, and when none is idle the new one is closed at once; a request's
headers must arrive within ``ADMIN_IDLE_TIMEOUT`` (5 s) of the connection (or of the
previous response) and a kept-alive connection is closed after as long idle.
Without this, idle connections were never closed and filled the
supervisor's fd table (then libzmq aborts it: see ``fdbudget``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog

from numaserve.config import AdminConfig
from numaserve.errors import NumaserveError

# h11 is imported when the endpoint starts, not by every CLI command that reads
# the config; prometheus_client and the collector at the first /metrics request.

__all__ = [
    "ADMIN_MAX_CONNECTIONS",
    "AdminConfig",
    "AdminHandle",
    "LoopHeartbeat",
    "build_app",
    "open_admin_socket",
    "start_admin",
]

log = structlog.get_logger("numaserve.admin")

#: Connections accepted per readiness event (and the listen backlog): the fd budget counts them.
ACCEPT_BATCH = 16

#: Open admin HTTP connections at most (a scraper, a load balancer's checks and a few curls), and the
#: seconds one may sit without a complete request: the fd budget counts them, slow clients must not pin them.
ADMIN_MAX_CONNECTIONS = 64
ADMIN_IDLE_TIMEOUT = 5.0

#: The supervision loop ticks at least every 0.2 s; 5 s without a tick is never normal.
HEARTBEAT_STALE_S = 5.0

Scope = Mapping[str, Any]
Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Mapping[str, Any]], Awaitable[None]]


class SupervisorView(Protocol):
    """What the admin app needs from the supervisor (a fake in tests)."""

    stopping: bool
    state: str

    def status(self) -> dict[str, Any]: ...


class LoopHeartbeat:
    """Monotonic time of the supervision loop's last tick (``beat()`` once per tick)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.last = clock()

    def beat(self) -> None:
        self.last = self._clock()

    def age(self) -> float:
        return max(0.0, self._clock() - self.last)


# ----------------------------------------------------------------------- app


def _settled_degraded(snap: Mapping[str, Any], unready: list[dict[str, Any]]) -> bool:
    """Degraded, and every missing slot is ``failed`` (not merely restarting)."""
    sv = snap.get("supervisor")
    state = sv.get("state") if isinstance(sv, Mapping) else None
    return state == "degraded" and all(u.get("state") == "failed" for u in unready)


def _json(status: int, body: Mapping[str, Any]) -> tuple[int, bytes, bytes]:
    return status, json.dumps(body, default=str).encode() + b"\n", b"application/json"


def build_app(sup: SupervisorView, heartbeat: LoopHeartbeat, *, stale_after: float = HEARTBEAT_STALE_S,
              cpu_node: Mapping[int, int] | None = None) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The ASGI app (plain ASGI: no framework in the supervisor).

    The metrics stack (prometheus_client and the collector, ~2 MB of the supervisor's
    private memory) is imported at the first ``/metrics`` request, not at start: a
    supervisor nothing scrapes never pays for it.  ``/readyz`` and ``/healthz`` need none of it.
    """
    from numaserve.supervisor.readiness import unready_slots

    def snapshot() -> dict[str, Any]:
        snap = sup.status()
        sv = snap.get("supervisor")
        if isinstance(sv, dict):
            sv["loop_heartbeat_age_s"] = round(heartbeat.age(), 3)
        return snap

    registry: list[Any] = []  # built at the first scrape, then kept (the collector's high-water marks)

    def metrics() -> tuple[int, bytes, bytes]:
        from prometheus_client import exposition

        if not registry:
            from numaserve.supervisor.metrics import NumaserveCollector, make_registry

            registry.append(make_registry(NumaserveCollector(snapshot, cpu_node=cpu_node)))
        # every name is a classic one, so the 0.0.4 text format that every Prometheus reads
        ctype = getattr(exposition, "CONTENT_TYPE_PLAIN_0_0_4", exposition.CONTENT_TYPE_LATEST)
        return 200, exposition.generate_latest(registry[0]), ctype.encode()

    def healthz() -> tuple[int, bytes, bytes]:
        age = heartbeat.age()
        stopping = bool(getattr(sup, "stopping", False))
        body: dict[str, Any] = {"state": getattr(sup, "state", None), "loop_heartbeat_age_s": round(age, 3)}
        if stopping:
            return _json(503, {"status": "unhealthy", "reason": "stopping", **body})
        if age > stale_after:
            return _json(503, {"status": "unhealthy",
                               "reason": f"supervision loop has not ticked for {age:.1f}s (limit {stale_after:g}s)",
                               **body})
        return _json(200, {"status": "ok", **body})

    probes = getattr(sup, "readyz_probes", None)  # lbgrace.ProbeClock: is a balancer watching?

    def readyz() -> tuple[int, bytes, bytes]:
        if probes is not None:
            probes.seen()
        if getattr(sup, "stopping", False):
            return _json(503, {"status": "not ready", "reason": "stopping", "unready": []})
        try:
            snap = sup.status()
            unready = unready_slots(snap)
        except Exception as e:  # never a 500 from a probe: say why
            return _json(503, {"status": "not ready", "reason": f"status unavailable: {e!r}", "unready": []})
        if unready and _settled_degraded(snap, unready):
            # started with some slots failed (retried later) and the rest serving:
            # ready to take traffic at reduced capacity; say what is missing
            return _json(200, {"status": "degraded", "missing": unready})
        if unready:
            return _json(503, {"status": "not ready", "unready": unready})
        return _json(200, {"status": "ready"})

    routes: dict[str, Callable[[], tuple[int, bytes, bytes]]] = {
        "/metrics": metrics, "/healthz": healthz, "/readyz": readyz,
    }

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan is off; anything else is not for us
            return
        handler = routes.get(scope.get("path", ""))
        method = scope.get("method", "GET")
        headers: list[tuple[bytes, bytes]] = []
        if handler is None:
            status, body, ctype = 404, b"not found: try /metrics, /healthz or /readyz\n", b"text/plain"
        elif method not in ("GET", "HEAD"):
            status, body, ctype = 405, b"method not allowed\n", b"text/plain"
            headers.append((b"allow", b"GET, HEAD"))
        else:
            try:
                status, body, ctype = handler()
            except Exception as e:
                log.warning("admin_handler_failed", path=scope.get("path"), error=repr(e))
                status, body, ctype = 500, b"internal error\n", b"text/plain"
        headers += [(b"content-type", ctype), (b"content-length", str(len(body)).encode()),
                    (b"cache-control", b"no-store")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else body})

    return app


# -------------------------------------------------------------------- server


class ConnectionGuard:
    """Admission and deadlines for the admin server's connections (see the module docstring)."""

    def __init__(self, max_connections: int, idle_timeout: float) -> None:
        self.max_connections = max(1, int(max_connections))
        self.idle_timeout = idle_timeout
        self.open: OrderedDict[int, Any] = OrderedDict()   # oldest first
        self.accepted = self.refused = self.evicted = self.timed_out = 0

    def admit(self, proto: Any) -> bool:
        if len(self.open) >= self.max_connections:
            victim = next((p for p in self.open.values() if p.idle()), None)
            if victim is None:
                self.refused += 1
                return False
            self.evicted += 1
            self.open.pop(id(victim), None)
            victim.close_idle()
        self.accepted += 1
        self.open[id(proto)] = proto
        return True

    def forget(self, proto: Any) -> None:
        self.open.pop(id(proto), None)

    def status(self) -> dict[str, Any]:
        return {"open": len(self.open), "max_connections": self.max_connections, "accepted": self.accepted,
                "refused": self.refused, "evicted_idle": self.evicted, "closed_idle": self.timed_out}


def open_admin_socket(cfg: AdminConfig) -> socket.socket | None:
    """Bind and listen (call before any worker exists); None when disabled.

    Raises NumaserveError naming the key and the fix.
    """
    from numaserve.config import parse_bind

    if not cfg.bind:
        return None
    try:
        host, port = parse_bind(cfg.bind)
    except ValueError as e:
        raise NumaserveError(f"admin.bind = {cfg.bind!r}: {e}") from None
    from numaserve.supervisor.frontdoor import listen_tcp

    try:
        sock = listen_tcp(host, port, 64)
    except socket.gaierror as e:
        raise NumaserveError(f"admin.bind = {cfg.bind!r}: cannot resolve {host}: {e.strerror}") from None
    except OSError as e:
        raise NumaserveError(
            f"admin.bind = {cfg.bind!r}: cannot listen: {e.strerror} "
            '(another process holds the port? set [admin] bind = "" to disable the admin endpoint)'
        ) from None
    return sock  # non-inheritable (PEP 446): workers never get it


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if sock.family == socket.AF_INET6 else f"{host}:{port}"


@dataclass
class AdminHandle:
    """A running admin server; ``stop()`` once at supervisor exit."""

    server: Any          # numaserve.supervisor.adminhttp.AdminHTTPServer
    task: asyncio.Task[None]
    sock: socket.socket
    address: str
    heartbeat: LoopHeartbeat
    guard: ConnectionGuard | None = None
    _stopped: bool = field(default=False, repr=False)

    def connections_status(self) -> dict[str, Any] | None:
        return self.guard.status() if self.guard is not None else None

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    async def stop(self, timeout: float = 3.0) -> None:
        """Stop accepting, let in-flight scrapes finish (bounded), close the socket."""
        if self._stopped:
            return
        self._stopped = True
        self.server.request_stop()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout)
        except asyncio.CancelledError:
            if not self.task.cancelled():
                raise  # our caller is being cancelled: not ours to swallow
        except TimeoutError:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task
        except Exception as e:
            log.warning("admin_stop_error", error=repr(e))
        self.sock.close()


async def start_admin(sup: SupervisorView, cfg: AdminConfig, *, sock: socket.socket | None = None,
                      heartbeat: LoopHeartbeat | None = None, stale_after: float = HEARTBEAT_STALE_S,
                      cpu_node: Mapping[int, int] | None = None,
                      max_connections: int | None = None) -> AdminHandle | None:
    """Serve the admin app in the running loop; None when disabled.

    ``sock`` is the socket from ``open_admin_socket`` (bound early); without it
    one is bound here.  ``heartbeat`` defaults to ``sup.heartbeat``.
    ``max_connections``: the cap from the fd budget (default ``ADMIN_MAX_CONNECTIONS``).
    """
    if sock is None:
        sock = open_admin_socket(cfg)
    if sock is None:
        return None
    hb = heartbeat or getattr(sup, "heartbeat", None) or LoopHeartbeat()
    if cpu_node is None:
        topo = getattr(sup, "topology", None)
        cpu_node = topo.cpu_node() if topo is not None else None
    from numaserve.supervisor.adminhttp import AdminHTTPServer

    app = build_app(sup, hb, stale_after=stale_after, cpu_node=cpu_node)
    guard = ConnectionGuard(ADMIN_MAX_CONNECTIONS if max_connections is None else max_connections, ADMIN_IDLE_TIMEOUT)
    server = AdminHTTPServer(app, guard, backlog=ACCEPT_BATCH, graceful_s=2.0)
    task = asyncio.get_running_loop().create_task(server.serve(sock), name="admin-http")
    deadline = time.monotonic() + 5.0
    while not server.started and not task.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    if not server.started:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        sock.close()
        raise NumaserveError(f"admin endpoint on {cfg.bind} did not start")
    handle = AdminHandle(server=server, task=task, sock=sock, address=_address(sock), heartbeat=hb, guard=guard)
    log.info("admin_listening", address=handle.address, paths=["/metrics", "/healthz", "/readyz"])
    return handle
