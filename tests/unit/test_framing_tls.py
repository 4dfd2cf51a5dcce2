"""TLS settings: the supervisor's up-front check of cert/key/CA files, and the server context."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import pytest

from numaserve.errors import ConfigError
from numaserve.worker.tls import TlsConfig, build_server_context, check_tls


def make_cert(d: Path, name: str) -> tuple[Path, Path]:
    cert, key = d / f"{name}.crt", d / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", f"/CN={name}"], check=True, capture_output=True)
    return cert, key


def test_valid_files_pass_and_build_a_context(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path, "srv")
    ca, _ = make_cert(tmp_path, "ca")
    tls = TlsConfig(certfile=str(cert), keyfile=str(key), ca_certs=str(ca))
    check_tls(tls)
    ctx = build_server_context(tls)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    assert build_server_context(TlsConfig(certfile=str(cert), keyfile=str(key))).verify_mode == ssl.CERT_NONE
    check_tls(TlsConfig())  # disabled: nothing to check


@pytest.mark.parametrize("case,fragment", [
    ("missing_cert", "tls.certfile"),
    ("missing_key", "tls.keyfile"),
    ("garbage_cert", "cannot load certificate and key"),
    ("wrong_key", "cannot load certificate and key"),
    ("garbage_ca", "tls.ca_certs"),
    ("bad_ciphers", "tls.ciphers"),
    ("key_without_cert", "tls.certfile is empty"),
])
def test_bad_files_are_clear_config_errors(tmp_path: Path, case: str, fragment: str) -> None:
    cert, key = make_cert(tmp_path, "srv")
    _, other_key = make_cert(tmp_path, "other")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a pem\n")
    tls = {
        "missing_cert": TlsConfig(certfile=str(tmp_path / "nope.crt"), keyfile=str(key)),
        "missing_key": TlsConfig(certfile=str(cert), keyfile=str(tmp_path / "nope.key")),
        "garbage_cert": TlsConfig(certfile=str(junk), keyfile=str(key)),
        "wrong_key": TlsConfig(certfile=str(cert), keyfile=str(other_key)),
        "garbage_ca": TlsConfig(certfile=str(cert), keyfile=str(key), ca_certs=str(junk)),
        "bad_ciphers": TlsConfig(certfile=str(cert), keyfile=str(key), ciphers="NOPE-NOTHING"),
        "key_without_cert": TlsConfig(keyfile=str(key)),
    }[case]
    with pytest.raises(ConfigError) as ei:
        check_tls(tls)
    assert fragment in str(ei.value)
