"""Access log lines in gunicorn's ``%(x)s`` format, with the request's duration.

uvicorn's own access line is written when the response *starts*, so it can
carry neither the duration nor the size; this middleware writes one line when
the response has ended (or the app failed), through the ``numaserve.access``
logger (uvicorn silences ``uvicorn.access`` when its own line is off), so it
comes out in the process's log format (a JSON object with the
line as ``event`` under ``log.format = "json"``) at level info.

Fields (``server.access_log_format``; the same letters as gunicorn's):

====================  ==========================================================
``%(h)s``             client address (after proxy headers, when trusted)
``%(l)s`` ``%(u)s``   ``-`` (identd and user: kept for gunicorn formats)
``%(t)s``             request start, ``[03/Dec/2026:20:07:56 +0000]``
``%(r)s``             request line, ``GET /path?q=1 HTTP/1.1``
``%(m)s`` ``%(U)s``   method; path (with the root path)
``%(q)s`` ``%(H)s``   query string; protocol, ``HTTP/1.1``
``%(s)s``             response status (500 when the app failed before answering)
``%(b)s`` ``%(B)s``   response body bytes (``-`` for none); the same, 0 for none
``%(f)s`` ``%(a)s``   Referer; User-Agent (``-`` when absent)
``%(D)s``             duration in microseconds (integer)
``%(M)s``             duration in milliseconds (integer)
``%(L)s``             duration in seconds, 6 decimals
``%(T)s``             duration in whole seconds
``%(p)s``             worker pid
``%({name}i)s``       request header ``name``; ``%({name}o)s`` response header
====================  ==========================================================

A refusal (a response with ``x-numaserve-refusal``, ``numaserve.refusals``) gets
`` refusal=<reason>`` appended to its line, whatever the format.

The worker puts it outermost in its ASGI chain (``worker.edge.build_stack``), so
the edge's own answers (503 when shedding, 413, 408) are logged too; the HTTP
protocol's refusals before any ASGI call are written through ``log_answer``.  The
duration runs from the request entering the chain (its head parsed; admitted
already when the protocol decides admission, admission's wait included when
the edge does) to its last response byte handed to the transport.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from numaserve.refusals import refusal_of

__all__ = ["DEFAULT_FORMAT", "FIELDS", "AccessLogMiddleware", "compile_format"]

DEFAULT_FORMAT = '%(h)s "%(r)s" %(s)s %(b)s %(D)sus'

FIELDS = "h l u t r m U q H s b B f a D M L T p".split()

_FIELD_RE = re.compile(r"%\(([^()]*)\)s")
_HEADER_RE = re.compile(r"^\{([!#$%&'*+.^_`|~0-9A-Za-z-]+)\}([io])$")

Record = tuple[dict[str, Any], int, int, list[tuple[bytes, bytes]], float, float]
Part = Callable[[Record], str]


def _header(headers: Any, name: bytes) -> str:
    for k, v in headers or ():
        if k.lower() == name:
            return v.decode("latin-1")
    return "-"


def _path(scope: dict[str, Any]) -> str:
    path = scope.get("path", "")
    qs = scope.get("query_string", b"")
    return f"{path}?{qs.decode('latin-1')}" if qs else path


def _part(name: str) -> Part:
    """One field's renderer from a record (scope, status, bytes, response headers, start, duration)."""
    m = _HEADER_RE.match(name)
    if m:
        hname = m.group(1).lower().encode("latin-1")
        if m.group(2) == "i":
            return lambda r: _header(r[0].get("headers"), hname)
        return lambda r: _header(r[3], hname)
    simple: dict[str, Part] = {
        "h": lambda r: (r[0].get("client") or ("-",))[0],
        "l": lambda r: "-",
        "u": lambda r: "-",
        "t": lambda r: time.strftime("[%d/%b/%Y:%H:%M:%S +0000]", time.gmtime(r[4])),
        "r": lambda r: f"{r[0].get('method', '-')} {_path(r[0])} HTTP/{r[0].get('http_version', '1.1')}",
        "m": lambda r: r[0].get("method", "-"),
        "U": lambda r: r[0].get("path", ""),
        "q": lambda r: r[0].get("query_string", b"").decode("latin-1"),
        "H": lambda r: f"HTTP/{r[0].get('http_version', '1.1')}",
        "s": lambda r: str(r[1]),
        "b": lambda r: str(r[2]) if r[2] else "-",
        "B": lambda r: str(r[2]),
        "f": lambda r: _header(r[0].get("headers"), b"referer"),
        "a": lambda r: _header(r[0].get("headers"), b"user-agent"),
        "D": lambda r: str(int(r[5] * 1e6)),
        "M": lambda r: str(int(r[5] * 1e3)),
        "L": lambda r: f"{r[5]:.6f}",
        "T": lambda r: str(int(r[5])),
        "p": lambda r: f"<{os.getpid()}>",
    }
    if name not in simple:
        raise ValueError(f"unknown field %({name})s: expected one of "
                         + ", ".join(f"%({f})s" for f in FIELDS) + ", %({header}i)s or %({header}o)s")
    return simple[name]


def compile_format(fmt: str) -> Callable[[Record], str]:
    """The renderer of an access log format; ValueError naming the first unknown field."""
    parts: list[Part | str] = []
    pos = 0
    for m in _FIELD_RE.finditer(fmt):
        if m.start() > pos:
            parts.append(fmt[pos:m.start()])
        parts.append(_part(m.group(1)))
        pos = m.end()
    if pos < len(fmt):
        parts.append(fmt[pos:])
    if not any(callable(p) for p in parts):
        raise ValueError("no field in it: e.g. " + DEFAULT_FORMAT)

    def render(record: Record) -> str:
        return "".join(p if isinstance(p, str) else p(record) for p in parts)

    return render


ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]


class AccessLogMiddleware:
    """Writes one access line per HTTP request once its response has ended (websockets pass through)."""

    def __init__(self, app: ASGIApp, fmt: str = "", logger: logging.Logger | None = None) -> None:
        self.app = app
        self.render = compile_format(fmt or DEFAULT_FORMAT)
        self.logger = logger or logging.getLogger("numaserve.access")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.logger.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        wall, t0 = time.time(), time.perf_counter()
        status = 0
        sent = 0
        headers: list[tuple[bytes, bytes]] = []

        async def send_counted(message: Any) -> None:
            nonlocal status, sent, headers
            kind = message["type"]
            if kind == "http.response.start":
                status = int(message["status"])
                headers = list(message.get("headers") or ())
            elif kind == "http.response.body":
                sent += len(message.get("body") or b"")
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            self._write((scope, status or 500, sent, headers, wall, time.perf_counter() - t0))

    def enabled(self) -> bool:
        """Lines are written (the logger takes info)."""
        return self.logger.isEnabledFor(logging.INFO)

    def log_answer(self, scope: Any, status: int, sent: int, headers: list[tuple[bytes, bytes]],
                   duration_s: float) -> None:
        """The line of a request answered without an ASGI call (the HTTP protocol's refusals)."""
        self._write((scope, status, sent, headers, time.time() - duration_s, duration_s))

    def _write(self, record: Record) -> None:
        try:
            line = self.render(record)
            reason = refusal_of(record[3])
            if reason is not None:   # why this 503: whatever the format, the line says it
                line += f" refusal={reason}"
            self.logger.info(line)
        except Exception:  # a log line must never fail a request
            self.logger.exception("access_log_error")
