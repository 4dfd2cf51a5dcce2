"""TLS termination in the workers: ``[tls]`` settings and the server SSLContext.

Each worker builds its own context when it starts, so renewed certificate
files are picked up by ``numaserve reload`` (which starts new workers) with
no restart of the supervisor.  The supervisor checks the files before it
spawns (``check_tls``): a missing or broken cert/key is one clear config
error instead of workers that crash at start.
"""

from __future__ import annotations

import os
import ssl
from typing import Any, Callable

from numaserve.config import TlsConfig
from numaserve.errors import ConfigError

__all__ = ["TlsConfig", "build_server_context", "check_tls", "ssl_context_factory"]


def build_server_context(tls: TlsConfig) -> ssl.SSLContext:
    """A TLS >= 1.2 server context; client certificates required when ``ca_certs`` is set."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.certfile, tls.keyfile or None)
    if tls.ca_certs:
        ctx.load_verify_locations(cafile=tls.ca_certs)
        ctx.verify_mode = ssl.CERT_REQUIRED
    if tls.ciphers:
        ctx.set_ciphers(tls.ciphers)
    return ctx


def _check_file(key: str, path: str) -> None:
    if not os.path.exists(path):
        raise ConfigError(f"tls.{key} = {path!r}: file not found")
    if not os.path.isfile(path):
        raise ConfigError(f"tls.{key} = {path!r}: not a regular file")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"tls.{key} = {path!r}: not readable by this user (uid {os.getuid()})")


def check_tls(tls: TlsConfig) -> None:
    """Load cert, key and CA once; raise ``ConfigError`` naming the file and the reason."""
    if not tls.enabled:
        for key in ("keyfile", "ca_certs", "ciphers"):
            if getattr(tls, key):
                raise ConfigError(f"tls.{key} is set but tls.certfile is empty: set certfile to enable TLS")
        return
    _check_file("certfile", tls.certfile)
    if tls.keyfile:
        _check_file("keyfile", tls.keyfile)
    if tls.ca_certs:
        _check_file("ca_certs", tls.ca_certs)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(tls.certfile, tls.keyfile or None)
    except ssl.SSLError as e:
        where = f"tls.certfile {tls.certfile!r}" + (f" / tls.keyfile {tls.keyfile!r}" if tls.keyfile else "")
        raise ConfigError(f"{where}: cannot load certificate and key ({e.reason or e}): "
                          "expected PEM files whose key matches the certificate") from None
    if tls.ca_certs:
        try:
            ctx.load_verify_locations(cafile=tls.ca_certs)
        except ssl.SSLError as e:
            raise ConfigError(f"tls.ca_certs = {tls.ca_certs!r}: cannot load CA certificates "
                              f"({e.reason or e}): expected PEM") from None
    if tls.ciphers:
        try:
            ctx.set_ciphers(tls.ciphers)
        except ssl.SSLError:
            raise ConfigError(f"tls.ciphers = {tls.ciphers!r}: no cipher matches (OpenSSL cipher list syntax)") from None


def ssl_context_factory(tls: TlsConfig) -> Callable[[Any, Any], ssl.SSLContext]:
    """For ``uvicorn.Config(ssl_context_factory=...)``: our context, built at worker start."""

    def factory(config: Any, default: Any) -> ssl.SSLContext:
        del config, default
        return build_server_context(tls)

    return factory
