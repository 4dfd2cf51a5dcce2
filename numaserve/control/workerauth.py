"""Binding a worker's control-channel identity to the process the supervisor spawned.

Anyone who can reach ``control.sock`` could otherwise claim a slot with a
``Hello`` naming the worker's pid (and then feed fake stats and heartbeats,
or receive its Drain).  Two independent proofs are required instead:

* a per-spawn secret: 128 random bits written into a pipe whose read end is
  the only copy the child inherits (``pass_fds``).  The worker reads and
  closes it before importing the app.  A pipe rather than an environment
  variable: ``/proc/PID/environ`` keeps the initial environment readable for
  the process's whole life, even after ``os.environ`` forgets it; the pipe
  is empty and closed a few milliseconds after start.
* the kernel's word on the sender: ``SO_PEERCRED`` of the ipc connection
  (see ``numaserve.control.peercred``) must name the spawned pid.

``check_hello`` is pure; the arbiter counts and drops what it refuses and
never signals a pid that a message names.
"""

from __future__ import annotations

import hmac
import os
import secrets
from typing import Any

from numaserve.control.peercred import PeerCred

__all__ = ["TOKEN_FD_ENV", "check_hello", "check_sender", "new_token", "read_token", "take_token", "token_pipe"]

#: Environment variable naming the inherited pipe fd (the number is not secret; the pipe is).
TOKEN_FD_ENV = "NUMASERVE_TOKEN_FD"
TOKEN_BYTES = 16
_MAX_TOKEN_TEXT = 256


def new_token() -> str:
    return secrets.token_hex(TOKEN_BYTES)


def token_pipe(token: str) -> int:
    """A pipe holding ``token``; returns the read end (non-inheritable until passed in ``pass_fds``).

    The caller closes it after the spawn (the child has its own copy by then).
    """
    r, w = os.pipe()
    try:
        os.write(w, token.encode("ascii"))
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return r


def read_token(fd: int) -> str:
    """Worker side: read the spawn token from the inherited pipe and close it ("" when absent)."""
    if fd < 0:
        return ""
    try:
        data = os.read(fd, _MAX_TOKEN_TEXT)
    except OSError:
        return ""
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    return data.decode("ascii", "replace").strip()


def take_token(environ: Any = None) -> str:
    """Worker side: read the spawn token named by ``NUMASERVE_TOKEN_FD`` and forget the variable."""
    env = os.environ if environ is None else environ
    text = env.pop(TOKEN_FD_ENV, "")
    try:
        fd = int(text)
    except ValueError:
        return ""
    return read_token(fd)


def check_sender(expected_pid: int, peer: PeerCred | None) -> str | None:
    """None when the connection's kernel credentials allow the sender, else why not."""
    if peer is not None and peer.pid != expected_pid:
        return f"sent by pid {peer.pid} (SO_PEERCRED), not the slot's worker pid {expected_pid}"
    return None


def check_hello(msg: Any, *, expected_pid: int, expected_token: str | None,
                peer: PeerCred | None) -> str | None:
    """None when ``msg`` (a Hello) comes from the spawned worker, else the reason to refuse it.

    ``expected_token`` None: the worker was spawned without a token (only in
    tests that build WorkerProc by hand); the other checks still apply.
    """
    why = check_sender(expected_pid, peer)
    if why:
        return why
    if expected_token is not None:
        token = msg.token if isinstance(getattr(msg, "token", None), str) else ""
        if not hmac.compare_digest(token.encode("utf-8", "replace"), expected_token.encode("ascii")):
            return "wrong or missing spawn token"
    if msg.pid != expected_pid:
        return f"names pid {msg.pid}, the slot's worker is pid {expected_pid}"
    return None
