"""The fixed error classes, shared by HTTP answers and frame error frames.

Clients get the same status number for the same failure whichever protocol
they speak, and the same JSON body shape (the admission middleware's):
``{"error": {"type": ..., "code": status, "message": ...}}``.

=====  ================  ============================================  =================
code   type              when                                          connection
=====  ================  ============================================  =================
400    protocol_error    malformed request / frame (bad HTTP, bad      closed
                         payload, empty frame)
408    read_timeout      request head/body or a partial frame not      closed
                         received within server.read_timeout
413    too_large         body over server.max_body_bytes, frame over   closed
                         framing.max_frame_bytes
431    header_too_large  request line + headers over                   closed
                         server.max_header_bytes
429    rate_limited      supervisor rate quota empty (+ Retry-After)   kept
503    overloaded        admission queue full / shed (+ Retry-After);  kept when the
                         server.max_connections reached                request's body was
                                                                       read; closed when
                                                                       not, by the
                                                                       sentinel and at
                                                                       the connection
                                                                       limit
504    timeout           deadline (x-request-timeout / frame           kept
                         ``timeout``) passed before the response
500    internal          the app raised or returned no response        kept (frames), as
                                                                       uvicorn (HTTP)
=====  ================  ============================================  =================

Refusals (429, 503, 504) also name their reason in ``x-numaserve-refusal``
(``numaserve.refusals``).

Every error numaserve answers itself (the edge middleware, the HTTP
protocol's own 400/408/431, the connection limit's 503, admission, frames)
uses this body; errors the app answers are the app's business.
"""

from __future__ import annotations

import json
from typing import NamedTuple

__all__ = ["ERROR_CLASSES", "ErrorClass", "error_body", "error_headers"]


class ErrorClass(NamedTuple):
    status: int
    type: str
    closes: bool          # the server closes the connection after answering
    retry_after: bool     # a Retry-After header is sent


ERROR_CLASSES: dict[int, ErrorClass] = {
    400: ErrorClass(400, "protocol_error", True, False),
    408: ErrorClass(408, "read_timeout", True, False),
    413: ErrorClass(413, "too_large", True, False),
    431: ErrorClass(431, "header_too_large", True, False),
    429: ErrorClass(429, "rate_limited", False, True),
    503: ErrorClass(503, "overloaded", False, True),
    504: ErrorClass(504, "timeout", False, False),
    500: ErrorClass(500, "internal", False, False),
}


def error_body(status: int, message: str) -> bytes:
    """The JSON error body for ``status`` (same shape as admission's answers)."""
    cls = ERROR_CLASSES.get(status)
    return json.dumps({"error": {"type": cls.type if cls else "error", "code": status,
                                 "message": message}}, separators=(",", ":")).encode()


def error_headers(status: int, body: bytes, retry_after: int = 1) -> list[tuple[bytes, bytes]]:
    """Headers for an error answer: JSON type, length, Retry-After when the class has one."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    cls = ERROR_CLASSES.get(status)
    if cls is not None and cls.retry_after:
        headers.append((b"retry-after", str(max(1, retry_after)).encode()))
    return headers
