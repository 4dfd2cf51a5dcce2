"""The runtime directory: control sockets, lock and pid file, mode 0700.

Resolution order: ``supervisor.runtime_dir`` (config/flag) → ``$RUNTIME_DIRECTORY``
(systemd's ``RuntimeDirectory=``) → ``/run/numaserve`` when we may create it →
``$XDG_RUNTIME_DIR/numaserve`` → ``/tmp/numaserve-<uid>``.  The directory is
created under umask 077 so sockets bound inside are never reachable by other
users, not even for the instant between bind and chmod.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from numaserve.errors import NumaserveError, UsageError

CONTROL_SOCKET = "control.sock"
OPS_SOCKET = "ops.sock"
OPS_RO_SOCKET = "ops-ro.sock"
AUDIT_LOG = "audit.log"
EVENTS_SOCKET = "events.sock"
LOCK_FILE = "supervisor.lock"
PID_FILE = "supervisor.pid"
PROGRESS_DIR = "progress"   # loading processes' numaserve.progress files


def resolve_runtime_dir(configured: str = "", environ: dict[str, str] | None = None) -> Path:
    """Pick the runtime directory (does not create it)."""
    env = os.environ if environ is None else environ
    if configured:
        return Path(configured)
    if env.get("RUNTIME_DIRECTORY"):
        # systemd may pass several, colon-separated; the first is ours
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0])
    run = Path("/run")
    if os.geteuid() == 0 and run.is_dir():
        return run / "numaserve"
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "numaserve"
    return Path(f"/tmp/numaserve-{os.getuid()}")


@contextlib.contextmanager
def tight_umask() -> Iterator[None]:
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def ensure_private_dir(path: Path, *, tighten: bool = True) -> None:
    """Create ``path`` 0700 (owned by us) or refuse one others could enter.

    ``tighten=False`` only checks: a process that does not (yet) hold the
    directory's lock must not change a live supervisor's directory (its mode
    may be 0710 on purpose, for ``ops.readonly_group``).
    """
    with tight_umask():
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise NumaserveError(f"runtime directory {path}: cannot create: {e.strerror}") from None
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode):
        raise NumaserveError(f"runtime directory {path}: exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise NumaserveError(
            f"runtime directory {path}: owned by uid {st.st_uid}, not us ({os.geteuid()}); refusing to use it"
        )
    if tighten and stat.S_IMODE(st.st_mode) & 0o077:
        # ours, but too open (e.g. created by hand, or 0710 from a previous run
        # with a read-only group): tighten before any socket exists
        os.chmod(path, 0o700)


@dataclass
class RuntimeDir:
    """An owned runtime directory; holding ``lock_fd`` marks a live supervisor."""

    path: Path
    lock_fd: int | None = None

    def endpoint(self, name: str) -> str:
        return f"ipc://{self.path / name}"

    def refuse_if_held(self) -> None:
        """UsageError when a live supervisor holds this directory; touches nothing.

        Lets ``start`` say so before anything else (a shared lock attempt on
        the existing lock file: no file is created, nothing is removed).
        """
        try:
            fd = os.open(self.path / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return  # no lock file (or no directory): nobody holds it
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UsageError(self._held_message()) from None
        finally:
            os.close(fd)

    def _held_message(self) -> str:
        pid = read_pid(self.path)
        return (f"another supervisor (pid {pid or '?'}) is running with runtime directory {self.path}; "
                "stop it first or use another --runtime-dir")

    def acquire(self) -> None:
        """Lock the directory for this supervisor and clear stale files.

        The lock is an flock, released by the kernel when a supervisor dies
        however it dies, so files a killed supervisor left behind never block
        the next start; a *live* supervisor's lock does.
        """
        # Nothing in the directory changes before the lock is ours: a refused
        # start (a live supervisor holds it) must leave that supervisor's
        # sockets, pid file and directory mode exactly as they were.
        ensure_private_dir(self.path, tighten=False)
        try:
            with tight_umask():
                fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise NumaserveError(f"runtime directory {self.path}: cannot create {LOCK_FILE}: {e.strerror} "
                                 "(it must be writable: set supervisor.runtime_dir or --runtime-dir)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise UsageError(self._held_message()) from None
            raise
        self.lock_fd = fd
        ensure_private_dir(self.path)  # ours now: tighten a mode left open (0710 from an earlier run)
        for name in (CONTROL_SOCKET, OPS_SOCKET, OPS_RO_SOCKET, EVENTS_SOCKET, PID_FILE):
            with contextlib.suppress(FileNotFoundError):
                (self.path / name).unlink()
        with tight_umask():
            tmp = self.path / (PID_FILE + ".tmp")
            tmp.write_text(f"{os.getpid()}\n")
            tmp.replace(self.path / PID_FILE)

    def share_with_group(self, group: str) -> int:
        """Let ``group`` traverse the directory (0710) to reach ops-ro.sock.

        Nothing else in the directory is group-accessible: every other file
        and socket is created 0600/0700 under the tight umask.
        """
        import grp

        try:
            gid = grp.getgrnam(group).gr_gid
        except KeyError:
            raise UsageError(f"ops.readonly_group = {group!r}: no such group") from None
        os.chown(self.path, -1, gid)
        os.chmod(self.path, 0o710)
        return gid

    def open_to_group(self, name: str, gid: int) -> None:
        p = self.path / name
        os.chown(p, -1, gid)
        os.chmod(p, 0o660)

    @property
    def held(self) -> bool:
        """True once ``acquire()`` succeeded (until ``release()``)."""
        return self.lock_fd is not None

    def release(self) -> None:
        """Remove our files and drop the lock; a no-op unless we hold the lock.

        Called on every exit path of ``start``, including a start refused
        because another supervisor holds the directory: those files are the
        other supervisor's, and removing them would cut its control plane.
        """
        if self.lock_fd is None:
            return
        for name in (CONTROL_SOCKET, OPS_SOCKET, OPS_RO_SOCKET, EVENTS_SOCKET, PID_FILE):
            with contextlib.suppress(OSError):  # gone, or the directory turned read-only
                (self.path / name).unlink()
        with contextlib.suppress(OSError):      # what processes stopped while loading left
            for f in (self.path / PROGRESS_DIR).iterdir():
                f.unlink()
            (self.path / PROGRESS_DIR).rmdir()
        os.close(self.lock_fd)
        self.lock_fd = None


def read_pid(path: Path) -> int | None:
    try:
        return int((path / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
