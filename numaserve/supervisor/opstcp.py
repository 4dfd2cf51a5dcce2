"""Remote ops over TCP: a CURVE-server ROUTER and its ZAP authenticator.

The TCP listener itself is a ``FrontDoor`` (bounded connections) that splices
to this socket's private ipc path; the keys it accepts are ``curvekeys``'.
"""

from __future__ import annotations

import os
from typing import Any

import structlog
import zmq
import zmq.asyncio

from numaserve.config import OpsConfig
from numaserve.errors import NumaserveError
from numaserve.supervisor import controlplane as cp
from numaserve.supervisor.curvekeys import AuthorizedKeys

__all__ = ["bind_curve_router"]

log = structlog.get_logger("numaserve.ops")


def bind_curve_router(ctx: zmq.asyncio.Context, ops: OpsConfig, endpoint: str) -> tuple[zmq.asyncio.Socket, AuthorizedKeys, Any]:
    """A CURVE-server ROUTER at ``endpoint``, its ZAP authenticator and the authorized keys.

    Raises NumaserveError naming ``ops.curve_secret_key`` / ``ops.curve_authorized_keys``
    when they cannot be used.  The ZAP handler runs in its own thread on a sync shadow of
    ``ctx`` (same libzmq context, so it authenticates our sockets), independent of the event
    loop, which does not exist yet when the supervisor opens its sockets.
    """
    import zmq.auth
    from zmq.auth.thread import ThreadAuthenticator

    try:
        public, secret = zmq.auth.load_certificate(ops.curve_secret_key)
    except (OSError, ValueError) as e:
        raise NumaserveError(f"ops.curve_secret_key {ops.curve_secret_key}: cannot load: {e}") from None
    if secret is None:
        raise NumaserveError(f"ops.curve_secret_key {ops.curve_secret_key}: holds no secret key")
    if not os.path.isdir(ops.curve_authorized_keys):
        raise NumaserveError(f"ops.curve_authorized_keys {ops.curve_authorized_keys}: not a directory")
    keys = AuthorizedKeys(ops.curve_authorized_keys)
    keys.load()
    authenticator = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
    authenticator.start()
    authenticator.configure_curve_callback(domain="*", credentials_provider=keys)
    sock = cp.bind_socket(ctx, zmq.ROUTER, endpoint, curve_secretkey=secret, curve_publickey=public,
                          curve_server=True)
    log.info("ops_tcp_listening", endpoint=ops.tcp_endpoint, auth="curve")
    return sock, keys, authenticator
