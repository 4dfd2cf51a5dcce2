"""ASGI middleware: counting, drain header, lifespan record, 413 and 408."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from numaserve.worker import edge
from numaserve.worker.middleware import BodyLimitMiddleware, LifespanRecord, MetricsMiddleware
from numaserve.worker.stats import WorkerStats


def http_scope(headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": "/", "headers": headers or []}


class Conn:
    """A fake server side: queued request messages in, sent messages out."""

    def __init__(self, *messages: dict[str, Any], stall: bool = False) -> None:
        self.incoming = list(messages)
        self.sent: list[dict[str, Any]] = []
        self.stall = stall

    async def receive(self) -> dict[str, Any]:
        if self.incoming:
            return self.incoming.pop(0)
        await asyncio.sleep(3600)  # a client that never sends more
        raise AssertionError

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return list(self.sent[0].get("headers", []))


def body(data: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.request", "body": data, "more_body": more}


def echo_app(status: int = 200) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        total = 0
        more = True
        while more:
            m = await receive()
            total += len(m.get("body", b""))
            more = m.get("more_body", False)
        payload = str(total).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
    return app


def run(app: Any, scope: dict[str, Any], conn: Conn) -> None:
    asyncio.run(app(scope, conn.receive, conn.send))


# --- MetricsMiddleware ------------------------------------------------------------


def test_counts_requests_by_status_class_and_latency() -> None:
    stats = WorkerStats()
    for status in (200, 201, 404, 503):
        run(MetricsMiddleware(echo_app(status), stats), http_scope(), Conn(body(b"abc")))
    assert stats.requests == 4 and stats.inflight == 0
    assert stats.status_classes == {"2xx": 2, "4xx": 1, "5xx": 1}
    assert stats.cumulative.count == 4


def test_inflight_is_visible_during_the_request() -> None:
    stats = WorkerStats()
    seen: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(stats.inflight)
        await echo_app()(scope, receive, send)

    run(MetricsMiddleware(app, stats), http_scope(), Conn(body(b"")))
    assert seen == [1] and stats.inflight == 0


def test_app_exception_counts_as_500_and_propagates() -> None:
    stats = WorkerStats()

    async def boom(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        run(MetricsMiddleware(boom, stats), http_scope(), Conn())
    assert stats.status_classes == {"5xx": 1} and stats.inflight == 0


def test_no_response_counts_as_500() -> None:
    stats = WorkerStats()

    async def silent(scope: Any, receive: Any, send: Any) -> None:
        return None

    run(MetricsMiddleware(silent, stats), http_scope(), Conn())
    assert stats.status_classes == {"5xx": 1}


def test_draining_adds_connection_close_once() -> None:
    stats = WorkerStats()
    mw = MetricsMiddleware(echo_app(), stats)
    conn = Conn(body(b""))
    run(mw, http_scope(), conn)
    assert (b"connection", b"close") not in conn.headers
    stats.draining = True
    conn = Conn(body(b""))
    run(mw, http_scope(), conn)
    assert conn.headers.count((b"connection", b"close")) == 1

    async def already_closing(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"Connection", b"Close"), (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    conn = Conn()
    run(MetricsMiddleware(already_closing, stats), http_scope(), conn)
    assert [k for k, _ in conn.headers].count(b"Connection") == 1 and len(conn.headers) == 2


def test_non_http_scopes_pass_through_uncounted() -> None:
    stats = WorkerStats()
    called: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        called.append(scope["type"])

    run(MetricsMiddleware(app, stats), {"type": "websocket"}, Conn())
    assert called == ["websocket"] and stats.requests == 0


def test_lifespan_startup_failure_message_is_recorded() -> None:
    record = LifespanRecord()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "no GPU"})

    conn = Conn({"type": "lifespan.startup"})
    run(MetricsMiddleware(app, WorkerStats(), record), {"type": "lifespan"}, conn)
    assert record.startup_failed_message == "no GPU"
    assert conn.sent == [{"type": "lifespan.startup.failed", "message": "no GPU"}]


def test_lifespan_exception_is_recorded_and_propagates() -> None:
    record = LifespanRecord()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise ValueError("bad config\nmore")

    with pytest.raises(ValueError):
        run(MetricsMiddleware(app, WorkerStats(), record), {"type": "lifespan"}, Conn())
    assert record.exception == "ValueError: bad config"


# --- BodyLimitMiddleware ----------------------------------------------------------


def test_declared_length_over_limit_is_413_without_calling_the_app() -> None:
    called = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        called.append(1)

    stats = WorkerStats()
    conn = Conn(body(b"x" * 101))
    run(BodyLimitMiddleware(app, 100, 5.0, stats), http_scope([(b"content-length", b"101")]), conn)
    assert not called and conn.status == 413 and (b"connection", b"close") in conn.headers
    assert stats.rejected_body_too_large == 1


def test_body_at_the_limit_is_fine() -> None:
    conn = Conn(body(b"x" * 60, more=True), body(b"x" * 40))
    run(BodyLimitMiddleware(echo_app(), 100, 5.0), http_scope([(b"content-length", b"100")]), conn)
    assert conn.status == 200 and conn.sent[1]["body"] == b"100"


def test_streamed_body_over_limit_is_413() -> None:
    conn = Conn(body(b"x" * 60, more=True), body(b"x" * 60, more=True), body(b""))
    run(BodyLimitMiddleware(echo_app(), 100, 5.0), http_scope(), conn)
    assert conn.status == 413 and b"too large" in conn.sent[1]["body"]


def test_zero_limit_means_unlimited() -> None:
    conn = Conn(body(b"x" * 5000))
    run(BodyLimitMiddleware(echo_app(), 0, 5.0), http_scope([(b"content-length", b"5000")]), conn)
    assert conn.status == 200


def test_slow_body_is_408() -> None:
    stats = WorkerStats()
    conn = Conn(body(b"x", more=True))  # then nothing more arrives
    run(MetricsMiddleware(BodyLimitMiddleware(echo_app(), 100, 0.1, stats), stats), http_scope(), conn)
    assert conn.status == 408 and (b"connection", b"close") in conn.headers
    assert stats.rejected_read_timeout == 1 and stats.status_classes == {"4xx": 1}


def test_waiting_for_disconnect_after_the_body_is_not_limited() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()  # the whole body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            await asyncio.wait_for(receive(), 0.3)  # longer than read_timeout: no 408
        except asyncio.TimeoutError:
            pass
        await send({"type": "http.response.body", "body": b"done"})

    conn = Conn(body(b"abc"))
    run(BodyLimitMiddleware(app, 100, 0.1), http_scope(), conn)
    assert conn.status == 200 and conn.sent[-1]["body"] == b"done"


def test_refusal_after_response_started_ends_the_exchange_without_raising() -> None:
    """No status can be sent any more: the app sees a disconnect, its later sends are dropped
    (uvicorn closes the connection when it returns without completing the response)."""
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while True:
            m = await receive()
            seen.append(m["type"])
            if m["type"] == "http.disconnect" or not m.get("more_body"):
                break
        await send({"type": "http.response.body", "body": b"late"})

    conn = Conn(body(b"x" * 80, more=True), body(b"x" * 80))
    stats = WorkerStats()
    run(BodyLimitMiddleware(app, 100, 5.0, stats), http_scope(), conn)
    assert seen == ["http.request", "http.disconnect"]
    assert len(conn.sent) == 1 and stats.rejected_body_too_large == 1


def json_error(conn: Conn) -> dict[str, Any]:
    headers = dict(conn.headers)
    assert headers[b"content-type"] == b"application/json"
    payload = b"".join(m.get("body", b"") for m in conn.sent[1:])
    assert int(headers[b"content-length"]) == len(payload)
    return json.loads(payload)["error"]


def test_413_and_408_bodies_are_the_documented_json() -> None:
    conn = Conn()
    run(BodyLimitMiddleware(echo_app(), 100, 5.0),
        http_scope([(b"content-length", b"101"), (b"expect", b"100-continue")]), conn)
    err = json_error(conn)
    assert err["type"] == "too_large" and err["code"] == 413 and "server.max_body_bytes" in err["message"]
    conn = Conn(body(b"x", more=True))
    run(BodyLimitMiddleware(echo_app(), 100, 0.05), http_scope(), conn)
    err = json_error(conn)
    assert err["type"] == "read_timeout" and err["code"] == 408 and "server.read_timeout" in err["message"]


def test_declared_length_over_limit_reads_and_drops_the_rest_before_closing() -> None:
    """Lingering read: a client still writing its body must not get RST instead of the 413."""
    conn = Conn(body(b"x" * 60, more=True), body(b"x" * 60, more=True), body(b"x" * 30))
    run(BodyLimitMiddleware(echo_app(), 100, 5.0), http_scope([(b"content-length", b"150")]), conn)
    assert conn.status == 413 and not conn.incoming  # the whole body was read (and dropped)
    assert conn.sent[1]["more_body"] is True and conn.sent[-1] == {
        "type": "http.response.body", "body": b"", "more_body": False}


def test_client_waiting_for_100_continue_is_answered_without_reading() -> None:
    conn = Conn(body(b"never sent"))
    run(BodyLimitMiddleware(echo_app(), 100, 5.0),
        http_scope([(b"expect", b"100-continue"), (b"content-length", b"1000")]), conn)
    assert conn.status == 413 and len(conn.incoming) == 1 and len(conn.sent) == 2


def test_linger_is_bounded_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(edge, "LINGER_S", 0.05)  # the lingering read lives in the edge module
    conn = Conn()  # the rest of the body never comes
    run(BodyLimitMiddleware(echo_app(), 100, 5.0), http_scope([(b"content-length", b"101")]), conn)
    assert conn.status == 413 and conn.sent[-1]["more_body"] is False


def framework_like_app(seen: list[str], raise_after: bool) -> Any:
    """Like FastAPI (answers 400 "error parsing the body") or Starlette (ClientDisconnect)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while True:
            m = await receive()
            seen.append(m["type"])
            if m["type"] == "http.disconnect":
                if raise_after:
                    raise RuntimeError("ClientDisconnect")
                await send({"type": "http.response.start", "status": 400, "headers": []})
                await send({"type": "http.response.body", "body": b"error parsing the body"})
                return
            if not m.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


@pytest.mark.parametrize("raise_after", [False, True])
def test_app_sees_a_disconnect_and_what_it_does_next_is_dropped(raise_after: bool) -> None:
    seen: list[str] = []
    stats = WorkerStats()
    conn = Conn(body(b"x" * 60, more=True), body(b"x" * 60, more=True), body(b"x" * 10))
    app = MetricsMiddleware(BodyLimitMiddleware(framework_like_app(seen, raise_after), 100, 5.0, stats), stats)
    run(app, http_scope(), conn)
    assert seen == ["http.request", "http.disconnect"]
    assert conn.status == 413 and [m["type"] for m in conn.sent].count("http.response.start") == 1
    assert stats.status_classes == {"4xx": 1} and stats.rejected_body_too_large == 1


def test_slow_body_app_sees_a_disconnect() -> None:
    seen: list[str] = []
    conn = Conn(body(b"x", more=True))
    run(BodyLimitMiddleware(framework_like_app(seen, True), 100, 0.05), http_scope(), conn)
    assert seen == ["http.request", "http.disconnect"] and conn.status == 408
    assert len(conn.sent) == 2 and (b"connection", b"close") in conn.headers


def test_app_exceptions_without_a_refusal_propagate() -> None:
    async def boom(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        raise ValueError("the app's own bug")

    with pytest.raises(ValueError):
        run(BodyLimitMiddleware(boom, 100, 5.0), http_scope(), Conn(body(b"abc")))


def test_lifespan_passes_through_body_limit() -> None:
    seen = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    run(BodyLimitMiddleware(app, 1, 0.01), {"type": "lifespan"}, Conn())
    assert seen == ["lifespan"]
