"""numaserve.accesslog: gunicorn-style fields, the duration, bad formats refused, one line per request."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from numaserve.accesslog import DEFAULT_FORMAT, AccessLogMiddleware, compile_format

SCOPE: dict[str, Any] = {
    "type": "http", "method": "POST", "path": "/api/v1/x", "query_string": b"a=1", "http_version": "1.1",
    "client": ("10.0.0.5", 4242),
    "headers": [(b"user-agent", b"curl/8"), (b"referer", b"http://r/"), (b"x-request-id", b"rid-7")],
}


def test_every_field_renders() -> None:
    render = compile_format('%(h)s %(l)s %(u)s "%(r)s" %(m)s %(U)s %(q)s %(H)s %(s)s %(b)s %(B)s '
                            '"%(f)s" "%(a)s" %(D)s %(M)s %(L)s %(T)s %({X-Request-Id}i)s %({content-type}o)s')
    line = render((SCOPE, 201, 0, [(b"content-type", b"text/plain")], 0.0, 1.5))
    assert line == ('10.0.0.5 - - "POST /api/v1/x?a=1 HTTP/1.1" POST /api/v1/x a=1 HTTP/1.1 201 - 0 '
                    '"http://r/" "curl/8" 1500000 1500 1.500000 1 rid-7 text/plain')
    assert compile_format("%(t)s")((SCOPE, 200, 5, [], 0.0, 0.0)) == "[01/Jan/1970:00:00:00 +0000]"
    assert compile_format("%(p)s %(h)s %(f)s")(({"type": "http"}, 200, 5, [], 0.0, 0.0)).endswith("> - -")


@pytest.mark.parametrize("fmt, words", [
    ("%(z)s", ["unknown field %(z)s", "%(D)s"]),
    ("%({bad header}i)s", ["unknown field %({bad header}i)s"]),
    ("just text", ["no field"]),
])
def test_bad_formats_are_refused_naming_the_field(fmt: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        compile_format(fmt)
    assert all(w in str(e.value) for w in words), str(e.value)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run(app: Any, fmt: str = "") -> list[str]:
    logger = logging.getLogger("test.accesslog")
    logger.setLevel(logging.INFO)
    cap = _Capture()
    logger.addHandler(cap)
    sent: list[Any] = []

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    try:
        asyncio.run(AccessLogMiddleware(app, fmt, logger)(dict(SCOPE), receive, send))
    except RuntimeError:
        pass
    finally:
        logger.removeHandler(cap)
    return cap.lines


def test_the_line_is_written_once_the_response_ended_with_size_and_duration() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"abc", "more_body": True})
        await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": b"de"})

    (line,) = _run(app, "%(s)s %(B)s %(D)s")
    status, size, micros = line.split()
    assert (status, size) == ("200", "5") and int(micros) >= 40_000   # the stream's whole life (the 50 ms sleep; timers may fire a tick early)
    (line,) = _run(app)
    assert line.startswith('10.0.0.5 "POST /api/v1/x?a=1 HTTP/1.1" 200 5 ') and line.endswith("us")
    assert DEFAULT_FORMAT.endswith("%(D)sus")


def test_a_failing_app_is_logged_as_500() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("boom")

    assert _run(app, "%(s)s %(b)s") == ["500 -"]
