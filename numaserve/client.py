"""A small client for numaserve's framed protocol (sync and asyncio).

Both keep one connection open and reuse it; both pipeline: the sync client
through :meth:`FrameClient.pipeline` (send every request, then read every
reply), the async one by letting any number of concurrent ``request`` calls
share the connection (replies are matched by ``id``, in any order).

>>> with FrameClient("127.0.0.1", 8000) as c:
...     r = c.request("POST", "/v1/embeddings", body={"input": "hello"})
...     r.status, r.json()["data"][0]["embedding"][:3]

Payloads are msgpack by default (``encoding="json"`` for JSON frames).
``ssl`` takes an ``ssl.SSLContext`` for a TLS listener.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import ssl as _ssl
from dataclasses import dataclass
from typing import Any, Iterable, Literal

from numaserve.framing import (
    DEFAULT_MAX_FRAME,
    HEADER,
    FrameDecoder,
    FrameError,
    decode_response,
    encode_request,
)

__all__ = ["AsyncFrameClient", "FrameClient", "FrameClientError", "Request", "Response"]

Encoding = Literal["msgpack", "json"]


class FrameClientError(ConnectionError):
    """The connection failed or the server sent something that is not a reply frame."""


@dataclass
class Response:
    """One reply frame: ``error`` is set on error frames (status 4xx/5xx from the server)."""

    id: Any
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    error: str | None = None

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Request:
    """A request for :meth:`FrameClient.pipeline`."""

    method: str = "GET"
    path: str = "/"
    headers: dict[str, str] | list[tuple[str, str]] | None = None
    body: Any = None
    timeout: float | None = None


def _response(obj: dict[str, Any]) -> Response:
    return Response(id=obj.get("id"), status=int(obj["status"]), headers=list(obj["headers"]),
                    body=obj["body"], error=obj.get("error"))


class FrameClient:
    """Blocking client over one reused connection."""

    def __init__(self, host: str, port: int, *, ssl: _ssl.SSLContext | None = None,
                 server_hostname: str | None = None, timeout: float = 30.0,
                 encoding: Encoding = "msgpack", max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.host, self.port = host, port
        self.ssl, self.server_hostname = ssl, server_hostname
        self.timeout = timeout
        self.as_json = encoding == "json"
        self.max_frame = max_frame
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder(max_frame)
        self._ids = itertools.count(1)
        self._early: dict[Any, Response] = {}

    def connect(self) -> None:
        if self._sock is not None:
            return
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.ssl is not None:
            sock = self.ssl.wrap_socket(sock, server_hostname=self.server_hostname or self.host)
        self._sock = sock
        self._decoder = FrameDecoder(self.max_frame)
        self._early.clear()

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def __enter__(self) -> "FrameClient":
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are (tests: truncated or bad frames)."""
        self.connect()
        assert self._sock is not None
        self._sock.sendall(data)

    def _send(self, rid: int, req: Request) -> None:
        payload = encode_request(rid, req.method, req.path, headers=req.headers, body=req.body,
                                 timeout=req.timeout, as_json=self.as_json)
        self.send_raw(HEADER.pack(len(payload)) + payload)

    def read_response(self) -> Response:
        """The next reply frame, whatever its id (raises FrameClientError on EOF)."""
        assert self._sock is not None
        while True:
            for payload in self._decoder.frames():
                return _response(decode_response(payload))
            buf = self._decoder.get_buffer()
            try:
                n = self._sock.recv_into(buf)
            except OSError as e:
                self.close()
                raise FrameClientError(f"connection failed: {e}") from e
            if n == 0:
                self.close()
                raise FrameClientError("connection closed by the server")
            self._decoder.buffer_updated(n)

    def _wait(self, rid: Any) -> Response:
        if rid in self._early:
            return self._early.pop(rid)
        while True:
            r = self.read_response()
            if r.id == rid or (r.id is None and r.error):  # connection-level error (no id known)
                return r
            self._early[r.id] = r
            if len(self._early) > 10000:
                raise FrameClientError("too many unmatched replies")

    def request(self, method: str = "GET", path: str = "/", *,
                headers: dict[str, str] | list[tuple[str, str]] | None = None,
                body: Any = None, timeout: float | None = None) -> Response:
        """One request; reconnects first if the last connection was closed."""
        rid = next(self._ids)
        self._send(rid, Request(method, path, headers, body, timeout))
        return self._wait(rid)

    def pipeline(self, requests: Iterable[Request]) -> list[Response]:
        """Send all, then read all; replies in the order of ``requests``."""
        ids = []
        for req in requests:
            rid = next(self._ids)
            self._send(rid, req)
            ids.append(rid)
        return [self._wait(rid) for rid in ids]


class AsyncFrameClient:
    """asyncio client: concurrent ``request`` calls are pipelined on one connection."""

    def __init__(self, host: str, port: int, *, ssl: _ssl.SSLContext | None = None,
                 server_hostname: str | None = None, encoding: Encoding = "msgpack",
                 max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.host, self.port = host, port
        self.ssl, self.server_hostname = ssl, server_hostname
        self.as_json = encoding == "json"
        self.max_frame = max_frame
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._waiters: dict[int, asyncio.Future[Response]] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    async def connect(self) -> None:
        async with self._lock:
            if self._writer is not None and not self._writer.is_closing():
                return
            reader, writer = await asyncio.open_connection(
                self.host, self.port, ssl=self.ssl,
                server_hostname=(self.server_hostname or self.host) if self.ssl else None)
            self._writer = writer
            self._reader_task = asyncio.get_running_loop().create_task(self._read_loop(reader))

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        error: BaseException = FrameClientError("connection closed by the server")
        try:
            while True:
                head = await reader.readexactly(HEADER.size)
                (n,) = HEADER.unpack(head)
                if n > self.max_frame:
                    raise FrameClientError(f"reply frame of {n} bytes over the limit {self.max_frame}")
                r = _response(decode_response(await reader.readexactly(n)))
                if r.id is None and r.error:  # connection-level error frame: it answers everyone
                    for fut in self._waiters.values():
                        if not fut.done():
                            fut.set_result(r)
                    continue
                fut = self._waiters.pop(r.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(r)
        except asyncio.IncompleteReadError:
            pass
        except (OSError, FrameError, FrameClientError) as e:
            error = e if isinstance(e, FrameClientError) else FrameClientError(str(e))
        finally:
            for fut in self._waiters.values():
                if not fut.done():
                    fut.set_exception(error)
            self._waiters.clear()
            if self._writer is not None:
                self._writer.close()

    async def request(self, method: str = "GET", path: str = "/", *,
                      headers: dict[str, str] | list[tuple[str, str]] | None = None,
                      body: Any = None, timeout: float | None = None) -> Response:
        await self.connect()
        assert self._writer is not None
        rid = next(self._ids)
        fut: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        payload = encode_request(rid, method, path, headers=headers, body=body, timeout=timeout,
                                 as_json=self.as_json)
        self._writer.write(HEADER.pack(len(payload)) + payload)
        try:
            return await fut
        finally:
            self._waiters.pop(rid, None)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except OSError:
                pass
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
        self._writer = None

    async def __aenter__(self) -> "AsyncFrameClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
