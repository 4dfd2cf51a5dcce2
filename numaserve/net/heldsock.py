"""Non-blocking socket calls that keep the GIL (libc through ``ctypes.PyDLL``).

Why: every ``socket`` method releases the GIL around its syscall and must win it
back afterwards.  A helper thread (the worker's shedding sentinel) competing
with a busy event loop waits up to ``sys.getswitchinterval()`` (5 ms) for each
re-acquisition, so answering one 503 with accept + recv + send + shutdown +
close costs ~25 ms of waiting.  These calls never block (``SOCK_NONBLOCK``
sockets, ``MSG_DONTWAIT``), take microseconds, and through ``PyDLL`` they run
with the GIL held: one acquisition answers a whole batch.

``AVAILABLE`` is False where libc cannot be loaded (then callers use ``socket``).
Each call returns a count/fd >= 0, or ``-errno``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import socket

__all__ = ["AVAILABLE", "EAGAIN", "accept", "close", "recv", "send", "shutdown_wr"]

EAGAIN = 11
_SOCK_NONBLOCK = 0o4000
_SOCK_CLOEXEC = 0o2000000
MSG_PEEK = socket.MSG_PEEK
_MSG_DONTWAIT = 0x40
_MSG_NOSIGNAL = 0x4000

try:
    _libc = ctypes.PyDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _accept4 = _libc.accept4
    _accept4.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    _recv = _libc.recv
    _recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _recv.restype = ctypes.c_ssize_t
    _send = _libc.send
    _send.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    _send.restype = ctypes.c_ssize_t
    _shutdown = _libc.shutdown
    _shutdown.argtypes = [ctypes.c_int, ctypes.c_int]
    _close = _libc.close
    _close.argtypes = [ctypes.c_int]
    AVAILABLE = socket.SOCK_NONBLOCK == _SOCK_NONBLOCK   # Linux values
except (OSError, AttributeError):   # pragma: no cover - not Linux/glibc
    AVAILABLE = False

_BUF = ctypes.create_string_buffer(65536) if AVAILABLE else None


def _ret(r: int) -> int:
    return r if r >= 0 else -ctypes.get_errno()


def accept(listen_fd: int) -> int:
    """A queued connection's fd (non-blocking, close-on-exec), or -errno (-EAGAIN: none)."""
    return _ret(_accept4(listen_fd, None, None, _SOCK_NONBLOCK | _SOCK_CLOEXEC))


def recv(fd: int, peek: bool = False) -> tuple[int, bytes]:
    """(count or -errno, the first byte read or b"") without blocking; 0 = the peer closed."""
    n = 1 if peek else len(_BUF)   # type: ignore[arg-type]
    r = _ret(_recv(fd, _BUF, n, _MSG_DONTWAIT | (MSG_PEEK if peek else 0)))
    return r, (_BUF.raw[:1] if r > 0 else b"")   # type: ignore[union-attr]


def send(fd: int, data: bytes) -> int:
    """Bytes queued for sending (no SIGPIPE, never blocks), or -errno."""
    return _ret(_send(fd, data, len(data), _MSG_DONTWAIT | _MSG_NOSIGNAL))


def shutdown_wr(fd: int) -> int:
    return _ret(_shutdown(fd, socket.SHUT_WR))


def close(fd: int) -> int:
    return _ret(_close(fd))
