"""Ops client: one request, one reply, with a timeout that names the endpoint.

Local: the ops socket in the supervisor's runtime directory (``--runtime-dir``).
Remote: ``--endpoint tcp://HOST:PORT`` with CURVE (``--curve-key`` = our
secret certificate, ``--curve-server-key`` = the supervisor's public one).
"""

from __future__ import annotations

import getpass
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from numaserve.control.messages import BadMessage, OpsReply, OpsRequest, decode_ops_reply
from numaserve.errors import NumaserveError
from numaserve.runtime import OPS_RO_SOCKET, OPS_SOCKET, read_pid


class OpsError(NumaserveError):
    """The supervisor answered with an error, or could not be reached."""


@dataclass
class OpsTarget:
    runtime_dir: Path | None = None
    endpoint: str | None = None           # tcp://... (CURVE) instead of the local socket
    curve_key: str | None = None          # client certificate with secret key
    curve_server_key: str | None = None   # supervisor's public certificate
    readonly: bool = False                # use ops-ro.sock (read-only verbs)

    def describe(self) -> str:
        return self.endpoint or f"ipc://{self.ipc_path()}"

    def ipc_path(self) -> Path:
        assert self.runtime_dir is not None
        return self.runtime_dir / (OPS_RO_SOCKET if self.readonly else OPS_SOCKET)


def denied(path: Path) -> str:
    return (f"permission denied on {path}: run as the supervisor's user or root "
            "(members of ops.readonly_group may run status and top)")


def socket_present(path: Path) -> bool:
    """Whether ``path`` exists; OpsError "permission denied on DIR" when we may not even look."""
    try:
        return path.exists()
    except PermissionError:
        raise OpsError(denied(path.parent)) from None


def _who() -> dict[str, Any]:
    try:
        user = getpass.getuser()
    except Exception:
        user = None
    return {"uid": os.getuid(), "user": user, "pid": os.getpid(), "host": socket.gethostname()}


def _connect(sock: zmq.Socket, target: OpsTarget) -> str:
    if target.endpoint:
        if not target.endpoint.startswith("tcp://"):
            raise OpsError(f"--endpoint {target.endpoint}: expected tcp://HOST:PORT")
        if not (target.curve_key and target.curve_server_key):
            raise OpsError("remote control needs --curve-key (your secret certificate) and "
                           "--curve-server-key (the supervisor's public certificate)")
        import zmq.auth

        try:
            pub, sec = zmq.auth.load_certificate(target.curve_key)
            server_pub, _ = zmq.auth.load_certificate(target.curve_server_key)
        except (OSError, ValueError) as e:
            raise OpsError(f"cannot load CURVE certificates: {e}") from None
        if sec is None:
            raise OpsError(f"--curve-key {target.curve_key}: holds no secret key")
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = pub, sec, server_pub
        sock.connect(target.endpoint)
        return target.endpoint
    assert target.runtime_dir is not None
    path = target.ipc_path()
    present = socket_present(path)
    if not present:
        raise OpsError(
            f"no supervisor is running with runtime directory {target.runtime_dir} ({path} does not exist); "
            "start one with `numaserve start` or pass --runtime-dir"
        )
    if not (os.access(path.parent, os.X_OK) and os.access(path, os.R_OK | os.W_OK)):
        raise OpsError(denied(path))
    sock.connect(f"ipc://{path}")
    return f"ipc://{path}"


def ops_call(target: OpsTarget | Path, verb: str, args: dict[str, Any] | None = None, *,
             timeout: float = 5.0) -> Any:
    """Send one ops request; return its result or raise OpsError with the reason."""
    if isinstance(target, Path):
        target = OpsTarget(runtime_dir=target)
    req = OpsRequest(verb=verb, args=args or {}, id=uuid.uuid4().hex[:12], who=_who(), timeout=float(timeout),
                     sent_at=time.time())
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
    try:
        where = _connect(sock, target)
        sock.send(msgspec.msgpack.encode(req))
        try:
            data = sock.recv()
        except zmq.Again:
            pid = read_pid(target.runtime_dir) if target.runtime_dir else None
            raise OpsError(
                f"no reply from the supervisor{f' (pid {pid})' if pid else ''} on {where} within {timeout:g}s"
            ) from None
    except zmq.ZMQError as e:
        raise OpsError(f"cannot talk to the supervisor on {target.describe()}: {e}") from None
    finally:
        sock.close(0)
    try:
        reply: OpsReply = decode_ops_reply(data)
    except BadMessage as e:
        raise OpsError(f"malformed reply from the supervisor: {e}") from None
    if not reply.ok:
        raise OpsError(reply.error)
    return reply.result
