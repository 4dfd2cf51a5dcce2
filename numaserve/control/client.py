"""Ops client: one request, one reply, with a timeout that names the endpoint."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import msgspec
import zmq

from numaserve.control.messages import BadMessage, OpsReply, OpsRequest, decode_ops_reply
from numaserve.errors import NumaserveError
from numaserve.runtime import OPS_SOCKET, read_pid


class OpsError(NumaserveError):
    """The supervisor answered with an error, or could not be reached."""


def ops_call(runtime_dir: Path, verb: str, args: dict[str, Any] | None = None, *, timeout: float = 5.0) -> Any:
    """Send one ops request to the supervisor owning ``runtime_dir``; return its result."""
    path = runtime_dir / OPS_SOCKET
    if not path.exists():
        raise OpsError(
            f"no supervisor is running with runtime directory {runtime_dir} ({path} does not exist); "
            "start one with `numaserve start` or pass --runtime-dir"
        )
    if not _accessible(path):
        raise OpsError(f"permission denied: {path} (run as the supervisor's user or root)")
    req = OpsRequest(verb=verb, args=args or {}, id=uuid.uuid4().hex[:12])
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
    try:
        sock.connect(f"ipc://{path}")
        sock.send(msgspec.msgpack.encode(req))
        try:
            data = sock.recv()
        except zmq.Again:
            pid = read_pid(runtime_dir)
            raise OpsError(
                f"no reply from the supervisor (pid {pid or '?'}) on ipc://{path} within {timeout:g}s"
            ) from None
    except zmq.ZMQError as e:
        raise OpsError(f"cannot talk to the supervisor on ipc://{path}: {e}") from None
    finally:
        sock.close(0)
    try:
        reply: OpsReply = decode_ops_reply(data)
    except BadMessage as e:
        raise OpsError(f"malformed reply from the supervisor: {e}") from None
    if not reply.ok:
        raise OpsError(reply.error)
    return reply.result


def _accessible(path: Path) -> bool:
    import os

    return os.access(path.parent, os.X_OK) and os.access(path, os.R_OK | os.W_OK)
