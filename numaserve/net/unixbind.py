"""Unix domain socket binds (``unix:/run/numaserve.sock``): what nginx and sidecars connect to.

SO_REUSEPORT does not balance AF_UNIX, so a unix bind is *one* socket that
the supervisor creates and holds, and every worker accepts from its own
inherited duplicate (gunicorn's model): whichever worker is free first takes
the next connection.  Steering, the hot set and stranded-queue rescue are
for the TCP reuseport groups only; on the unix socket a worker that exits
leaves its queue to the others (and to its replacement), so nothing queued
is lost across restarts.

A socket file left by a killed supervisor is stale (connecting to it is
refused) and is replaced; one another server listens on is refused (exit 2);
anything that is not a socket is never removed.  The file is removed at stop,
only if it is still ours (same inode).
"""

from __future__ import annotations

import errno
import os
import socket
import stat

from numaserve.errors import NumaserveError, UsageError

# the bind syntax lives in numaserve.unixaddr (the config schema checks it)

__all__ = ["check_unix_path", "make_unix_listener", "remove_unix_socket"]


def check_unix_path(path: str) -> bool:
    """Before anything starts: True when a stale socket file is there (to replace),
    False when the path is free; UsageError (exit 2) when a server listens on it,
    it is not a socket, or its directory is missing."""
    parent = os.path.dirname(path) or "/"
    if not os.path.isdir(parent):
        raise UsageError(f"server.bind unix:{path}: directory {parent} does not exist")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode):
        raise UsageError(f"server.bind unix:{path}: the path exists and is not a socket (not removed)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return True        # nobody listens: left by a server that was killed
    except OSError as e:
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return True
        if e.errno == errno.EAGAIN:   # a listener with a full queue is a live one
            raise UsageError(f"server.bind unix:{path}: another server listens on it (its queue is full)") from None
        raise UsageError(f"server.bind unix:{path}: cannot tell whether a server listens on it: {e.strerror}") from None
    finally:
        probe.close()
    raise UsageError(f"server.bind unix:{path}: another server listens on it: stop it or choose another path")


def make_unix_listener(path: str, backlog: int, mode: int, gid: int | None) -> tuple[socket.socket, int]:
    """Bind, set mode and group, listen (non-blocking, like the TCP listeners); returns the
    socket and its file's inode (to remove only our own file at stop).

    The mode is applied before ``listen()``, so no client can connect through a
    wider mode in between.
    """
    if check_unix_path(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, mode)
        if gid is not None:
            os.chown(path, -1, gid)
        sock.listen(backlog)
        sock.setblocking(False)
        ino = os.lstat(path).st_ino
    except OSError as e:
        sock.close()
        raise NumaserveError(f"cannot listen on unix:{path}: {e.strerror}") from None
    return sock, ino


def remove_unix_socket(path: str, ino: int) -> None:
    """Unlink the socket file if it is still ours (another server may have replaced it)."""
    try:
        if os.lstat(path).st_ino == ino:
            os.unlink(path)
    except OSError:
        pass
