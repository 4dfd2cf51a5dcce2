"""The framed binary protocol: codec only (pure, no I/O).

Wire format, both directions: a 4-byte big-endian payload length, then the
payload.  The payload is JSON when its first byte is ``{`` and msgpack
otherwise (a msgpack map starts with 0x80-0x8f, 0xde or 0xdf, never ``{``);
a reply uses the encoding of its request.

Request:  ``{id, method="GET", path="/", headers={} | [[k, v], ...], body, timeout}``
Response: ``{id, status, headers=[[k, v], ...], body}``; error frames add
``error`` (a message) and use the same status numbers as HTTP
(``numaserve.errors_http``).

``body`` in a request: msgpack bin or str; in JSON a string (UTF-8 text), or
any JSON object/array, which is passed to the app as that JSON text
(``content-type: application/json`` unless given), or ``body_b64`` for binary.
In a JSON reply ``body`` is the UTF-8 text, or ``body_b64`` when the body is
not UTF-8.  ``timeout`` (seconds) becomes the request deadline
(``x-request-timeout``), answered with 504 when it passes.

The same port serves HTTP: :func:`looks_like_http` decides on the first byte
(an ASCII capital letter starts every HTTP method; as a frame length prefix
it would mean >= 1 GiB, far above :data:`MAX_FRAME_LIMIT`).  Empty lines
(CR, LF) may precede an HTTP request line; as a first byte they would mean
a frame of >= 160 MiB, also above the limit.

:class:`FrameDecoder` reads into one preallocated buffer handed to the
transport (``get_buffer``/``buffer_updated``); complete payloads are decoded
straight from views of that buffer, so bytes are never copied on the way in
except to compact a trailing partial frame.  The buffer is bounded by the
largest frame allowed.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Iterator

import msgspec

from numaserve.config import MAX_FRAME_LIMIT, FramingConfig

__all__ = [
    "DEFAULT_MAX_FRAME",
    "FrameDecoder",
    "FrameError",
    "FrameRequest",
    "FramingConfig",
    "HEADER",
    "MAX_FRAME_LIMIT",
    "decode_request",
    "decode_response",
    "encode_frame",
    "encode_request",
    "encode_response",
    "could_start_frame",
    "looks_like_http",
]

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME = 16 * 1024 * 1024
_INITIAL_BUFFER = 64 * 1024
_JSON_START = 0x7B  # "{"


class FrameError(Exception):
    """A frame that cannot be accepted; ``status`` is its error class (400 or 413)."""

    def __init__(self, status: int, message: str, request_id: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.request_id = request_id


def looks_like_http(first: int) -> bool:
    """True when a connection's first byte starts an HTTP request line (A-Z)."""
    return 0x41 <= first <= 0x5A


def could_start_frame(first: int, max_frame: int) -> bool:
    """True when ``first`` can be the first byte of a frame no longer than ``max_frame``: the
    top byte of its length prefix.  Anything else (a lowercase method, a TLS ClientHello's
    0x16, any text) is not a frame and is left to HTTP, which answers it with a 400."""
    return (first << 24) <= max_frame


class FrameDecoder:
    """Splits a byte stream into payloads, in one bounded, reused buffer.

    Use as the storage of an ``asyncio.BufferedProtocol``: return
    :meth:`get_buffer` from ``get_buffer`` and call :meth:`buffer_updated`,
    then iterate :meth:`frames`.  Each yielded payload is a view into the
    buffer that is valid until the next ``get_buffer``: decode it at once.
    A length over ``max_frame`` raises :class:`FrameError` (413): the stream
    cannot be resynchronised, so the connection must close.
    """

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, initial: int = _INITIAL_BUFFER) -> None:
        if not 0 < max_frame <= MAX_FRAME_LIMIT:
            raise ValueError(f"max_frame must be in 1..{MAX_FRAME_LIMIT}")
        self.max_frame = max_frame
        self._initial = min(initial, max_frame + HEADER.size)
        self._buf = bytearray(self._initial)
        self._start = 0  # first unconsumed byte
        self._end = 0    # one past the last received byte

    @property
    def capacity(self) -> int:
        return len(self._buf)

    @property
    def pending(self) -> int:
        """Bytes received but not yet returned as a complete frame."""
        return self._end - self._start

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Free space to read into (compacts, and grows only for a declared frame, as its bytes
        arrive: at most twice what was received, plus the initial size)."""
        del sizehint
        if self._start:
            n = self._end - self._start
            if n:
                self._buf[:n] = self._buf[self._start:self._end]
            self._start, self._end = 0, n
        need = self._needed()
        size = len(self._buf)
        if need > size and size - self._end < self._initial // 2:
            # grow with the bytes received, not to the declared length: a 4-byte prefix alone
            # must not make a connection hold max_frame bytes (doubling: amortised O(1) copies)
            grown = bytearray(min(need, max(2 * size, self._end + self._initial)))
            grown[:self._end] = self._buf[:self._end]
            self._buf = grown
        elif self._end == 0 and len(self._buf) > self._initial:
            self._buf = bytearray(self._initial)  # a big frame is done: give the memory back
        if self._end == len(self._buf):  # only if complete frames were left unconsumed
            raise FrameError(413, "frame buffer full: consume frames before reading more")
        return memoryview(self._buf)[self._end:]

    def _needed(self) -> int:
        """Buffer size needed for the frame that starts at offset 0."""
        if self._end < HEADER.size:
            return self._initial
        (length,) = HEADER.unpack_from(self._buf, 0)
        if length > self.max_frame:
            return self._initial  # refused in frames(); never allocate for it
        return max(self._initial, HEADER.size + length)

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes

    def feed_into(self, data: memoryview | bytes) -> None:
        """Copy ``data`` in (may grow the buffer past a frame, up to the frame limit + ``len(data)``)."""
        n = len(data)
        if self._start:
            self.get_buffer()  # compact
        if self._end + n > len(self._buf):
            grown = bytearray(self._end + n)
            grown[:self._end] = self._buf[:self._end]
            self._buf = grown
        self._buf[self._end:self._end + n] = data
        self._end += n

    def peek_payload_byte(self) -> int | None:
        """First payload byte of the frame being received (its encoding), if already here."""
        i = self._start + HEADER.size
        return self._buf[i] if i < self._end else None

    def frames(self) -> Iterator[memoryview]:
        """Complete payloads received so far (each consumed when yielded)."""
        view = memoryview(self._buf)
        while self._end - self._start >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buf, self._start)
            if length > self.max_frame:
                raise FrameError(413, f"frame of {length} bytes exceeds the limit of {self.max_frame}")
            stop = self._start + HEADER.size + length
            if stop > self._end:
                return
            payload = view[self._start + HEADER.size:stop]
            self._start = stop
            yield payload

    def feed(self, data: bytes) -> list[bytes]:
        """Copying convenience for tests and blocking clients: all complete payloads."""
        out: list[bytes] = []
        mv = memoryview(data)
        while mv:
            buf = self.get_buffer()
            n = min(len(buf), len(mv))
            if n == 0:  # only possible if the buffer is full of an unfinished frame
                raise FrameError(413, "frame buffer full")
            buf[:n] = mv[:n]
            self.buffer_updated(n)
            mv = mv[n:]
            out.extend(bytes(p) for p in self.frames())
        return out


# --- payloads ---------------------------------------------------------------------


class FrameRequest(msgspec.Struct, kw_only=True):
    """A decoded request (``body`` already bytes)."""

    id: Any = None
    method: str = "GET"
    path: str = "/"
    headers: list[tuple[bytes, bytes]] = []
    body: bytes = b""
    timeout: float | None = None
    json: bool = False  # the request came as JSON (answer in JSON)


class _WireRequest(msgspec.Struct, kw_only=True):
    id: int | str | None = None
    method: str = "GET"
    path: str = "/"
    headers: dict[str, str] | list[tuple[str, str]] = {}
    body: Any = None
    body_b64: str | None = None
    timeout: float | None = None


class _WireRequestJSON(msgspec.Struct, kw_only=True):
    id: int | str | None = None
    method: str = "GET"
    path: str = "/"
    headers: dict[str, str] | list[tuple[str, str]] = {}
    body: msgspec.Raw = msgspec.Raw(b"null")  # kept as JSON text, not parsed
    body_b64: str | None = None
    timeout: float | None = None


_json_req = msgspec.json.Decoder(_WireRequestJSON)
_mp_req = msgspec.msgpack.Decoder(_WireRequest)
_json_enc = msgspec.json.Encoder()
_mp_enc = msgspec.msgpack.Encoder()
_ANY_JSON = msgspec.json.Decoder()
_ANY_MP = msgspec.msgpack.Decoder()


class _Id(msgspec.Struct):
    id: int | str | None = None


def _salvage_id(payload: memoryview | bytes, is_json: bool) -> Any:
    """Best-effort request id from a payload that failed validation (for the error frame)."""
    try:
        dec = msgspec.json.decode if is_json else msgspec.msgpack.decode
        return dec(payload, type=_Id).id
    except Exception:  # noqa: BLE001 - garbage: no id
        return None


def decode_request(payload: memoryview | bytes) -> FrameRequest:
    """Decode one request payload; raises :class:`FrameError` (400) with a reason."""
    if len(payload) == 0:
        raise FrameError(400, "empty frame")
    is_json = payload[0] == _JSON_START
    try:
        wire = _json_req.decode(payload) if is_json else _mp_req.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, ValueError) as e:
        raise FrameError(400, f"bad {'JSON' if is_json else 'msgpack'} request: {str(e)[:200]}",
                         _salvage_id(payload, is_json)) from None
    rid = wire.id
    method = wire.method.upper()
    if not method or not method.isalpha() or len(method) > 16:
        raise FrameError(400, f"bad method {wire.method[:20]!r}", rid)
    path = wire.path
    if not path.startswith("/") or len(path) > 8192 or any(c in path for c in "\r\n\x00 "):
        raise FrameError(400, "path must start with / and contain no spaces or control characters", rid)
    items = wire.headers.items() if isinstance(wire.headers, dict) else wire.headers
    try:
        headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in items]
    except UnicodeEncodeError:
        raise FrameError(400, "header names and values must be latin-1 text", rid) from None
    if any(b"\r" in k + v or b"\n" in k + v or not k for k, v in headers):
        raise FrameError(400, "bad header name or value", rid)
    body = b""
    if wire.body_b64 is not None:
        try:
            body = base64.b64decode(wire.body_b64, validate=True)
        except ValueError:
            raise FrameError(400, "body_b64 is not base64", rid) from None
    elif isinstance(wire.body, msgspec.Raw):
        raw = bytes(wire.body)
        if raw[:1] == b'"':
            body = msgspec.json.decode(raw, type=str).encode("utf-8", "surrogatepass")
        elif raw != b"null":
            body = raw
            if not any(k == b"content-type" for k, _ in headers):
                headers.append((b"content-type", b"application/json"))
    elif isinstance(wire.body, bytes):
        body = wire.body
    elif isinstance(wire.body, str):
        body = wire.body.encode("utf-8", "surrogatepass")
    elif wire.body is not None:
        try:
            body = _json_enc.encode(wire.body)
        except (TypeError, ValueError, RecursionError) as e:
            raise FrameError(400, f"body cannot be sent as JSON: {e}", rid) from None
        if not any(k == b"content-type" for k, _ in headers):
            headers.append((b"content-type", b"application/json"))
    timeout = wire.timeout
    if timeout is not None and not (timeout > 0):
        raise FrameError(400, "timeout must be a number > 0", rid)
    return FrameRequest(id=rid, method=method, path=path, headers=headers, body=body,
                        timeout=timeout, json=is_json)


def encode_frame(payload: bytes) -> bytes:
    """Length prefix + payload."""
    return HEADER.pack(len(payload)) + payload


def encode_response(request_id: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes, *,
                    as_json: bool, error: str | None = None) -> bytes:
    """One response payload (no prefix) in the request's encoding."""
    obj: dict[str, Any] = {
        "id": request_id,
        "status": status,
        "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers],
    }
    if as_json:
        try:
            obj["body"] = body.decode("utf-8")
        except UnicodeDecodeError:
            obj["body_b64"] = base64.b64encode(body).decode("ascii")
    else:
        obj["body"] = body
    if error is not None:
        obj["error"] = error
    return _json_enc.encode(obj) if as_json else _mp_enc.encode(obj)


def encode_request(request_id: Any, method: str = "GET", path: str = "/", *,
                   headers: dict[str, str] | list[tuple[str, str]] | None = None, body: Any = None,
                   timeout: float | None = None, as_json: bool = False) -> bytes:
    """One request payload (no prefix); used by the client and tests."""
    obj: dict[str, Any] = {"id": request_id, "method": method, "path": path}
    if headers:
        obj["headers"] = dict(headers) if isinstance(headers, dict) else [list(h) for h in headers]
    if timeout is not None:
        obj["timeout"] = timeout
    if body is not None:
        if as_json and isinstance(body, (bytes, bytearray, memoryview)):
            try:
                obj["body"] = bytes(body).decode("utf-8")
            except UnicodeDecodeError:
                obj["body_b64"] = base64.b64encode(bytes(body)).decode("ascii")
        else:
            obj["body"] = bytes(body) if isinstance(body, (bytearray, memoryview)) else body
    return _json_enc.encode(obj) if as_json else _mp_enc.encode(obj)


def decode_response(payload: memoryview | bytes) -> dict[str, Any]:
    """A response payload as a dict with ``body`` as bytes (client side)."""
    if len(payload) == 0:
        raise FrameError(400, "empty frame")
    is_json = payload[0] == _JSON_START
    try:
        obj = _ANY_JSON.decode(payload) if is_json else _ANY_MP.decode(payload)
    except (msgspec.DecodeError, RecursionError) as e:
        raise FrameError(400, f"bad response frame: {e}") from None
    if not isinstance(obj, dict) or "status" not in obj:
        raise FrameError(400, "response frame is not a map with a status")
    body = obj.get("body")
    if "body_b64" in obj:
        obj["body"] = base64.b64decode(obj.pop("body_b64"))
    elif isinstance(body, str):
        obj["body"] = body.encode("utf-8")
    elif body is None:
        obj["body"] = b""
    obj["headers"] = [tuple(h) for h in obj.get("headers") or []]
    return obj
