"""Connections the supervisor accepted but must not answer, handed back to the worker.

Why: the supervisor's shedder (``numaserve.supervisor.doorshed``) can only
see a connection's first byte after ``accept()``; one that is not HTTP (the
length-prefixed frames share the port) belongs to the worker, and the accept
queue cannot take it back.  So each worker binds a datagram socket next to
its gate page and adopts every TCP stream socket that arrives on it
(SCM_RIGHTS); anything else that arrives is closed.

Why a file in the runtime directory and not the abstract namespace: an
abstract name has no permissions, so another local user could bind a
worker's name first (or just after it exits) and receive client connections.
The runtime directory is 0700 (0710 at most) and the socket 0600 under the
tight umask: only the service's own user can send or bind there.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
from collections.abc import Callable

__all__ = ["HandBack", "handback_path", "send_fd"]

PAGE_SUFFIX = ".page"


def handback_path(page_path: str) -> str:
    """The worker's hand-back socket, beside its gate page (``gate-3.page`` -> ``gate-3.hb``)."""
    base = page_path[: -len(PAGE_SUFFIX)] if page_path.endswith(PAGE_SUFFIX) else page_path
    return base + ".hb"


def send_fd(path: str, fd: int, timeout: float = 0.05) -> None:
    """Send ``fd`` to the worker bound at ``path`` (raises OSError if it is not there or not reading).

    Not ``socket.send_fds``: on Python 3.11 it drops its ``address`` argument.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout)
        s.sendmsg([b"c"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], 0, path)


class HandBack:
    """The worker's end: ``open`` on the loop, ``close`` at exit."""

    def __init__(self, adopt: Callable[[socket.socket], None]) -> None:
        self.adopt = adopt
        self.sock: socket.socket | None = None
        self.path = ""
        self.adopted = 0
        self.refused = 0

    def open(self, loop: asyncio.AbstractEventLoop, path: str) -> bool:
        """Bind ``path`` (replacing a dead predecessor's file) and read it on ``loop``; False if it cannot."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            s.bind(path)
        except (OSError, ValueError):   # ValueError/OSError: the path is too long for AF_UNIX
            s.close()
            return False
        finally:
            os.umask(old)
        self.sock, self.path = s, path
        loop.add_reader(s.fileno(), self._read)
        return True

    def _read(self) -> None:
        s = self.sock
        if s is None:
            return
        for _ in range(16):
            try:
                _, fds, _, _ = socket.recv_fds(s, 16, 4)
            except OSError:   # BlockingIOError: nothing more queued
                return
            for fd in fds:
                try:
                    conn = socket.socket(fileno=fd)
                except OSError:
                    os.close(fd)
                    self.refused += 1
                    continue
                if conn.family in (socket.AF_INET, socket.AF_INET6) and conn.type == socket.SOCK_STREAM:
                    conn.setblocking(False)
                    self.adopted += 1
                    self.adopt(conn)
                else:
                    conn.close()
                    self.refused += 1

    def close(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self.sock is not None:
            if loop is not None:
                with contextlib.suppress(Exception):
                    loop.remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
            with contextlib.suppress(OSError):
                os.unlink(self.path)
