"""Remote control over TCP: CURVE-only; the read-only socket; `top` over the PUB stream."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.integration.harness import FAST_CONFIG, REPO, Running, free_port, numaserve_argv

pytestmark = pytest.mark.slow


def keygen(directory: Path, name: str) -> tuple[Path, Path]:
    r = subprocess.run(numaserve_argv("ops", "keygen", str(directory), "--name", name), capture_output=True,
                       text=True, timeout=60, cwd=str(REPO))
    assert r.returncode == 0, r.stderr
    return directory / f"{name}.key", directory / f"{name}.key_secret"


def test_remote_ops_need_an_authorized_curve_key(tmp_path: Path) -> None:
    server_pub, server_sec = keygen(tmp_path / "server", "server")
    client_pub, client_sec = keygen(tmp_path / "client", "client")
    _, stranger_sec = keygen(tmp_path / "stranger", "stranger")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    (authorized / "client.key").write_text(client_pub.read_text())
    port = free_port()
    cfg = FAST_CONFIG + (f'\n[ops]\ntcp_endpoint = "tcp://127.0.0.1:{port}"\ncurve_secret_key = "{server_sec}"\n'
                         f'curve_authorized_keys = "{authorized}"\n')
    with Running(["--nodes", "0", "--bind", "127.0.0.1:0"], config=cfg) as sup:
        base = ["--endpoint", f"tcp://127.0.0.1:{port}", "--curve-server-key", str(server_pub)]
        r = subprocess.run(numaserve_argv("status", "--json", *base, "--curve-key", str(client_sec)),
                           capture_output=True, text=True, timeout=60, cwd=str(REPO))
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["slots"][0]["state"] == "ready"
        # a key that is not authorized gets nothing (the ZAP handler drops the handshake)
        r = subprocess.run(numaserve_argv("status", *base, "--curve-key", str(stranger_sec), "--timeout", "2"),
                           capture_output=True, text=True, timeout=60, cwd=str(REPO))
        assert r.returncode == 1 and "no reply" in r.stderr, r.stderr
        # no keys at all: refused before anything is sent
        r = subprocess.run(numaserve_argv("status", "--endpoint", f"tcp://127.0.0.1:{port}"),
                           capture_output=True, text=True, timeout=60, cwd=str(REPO))
        assert r.returncode == 1 and "CURVE" in r.stderr or "curve" in r.stderr, r.stderr
        # the remote mutating command is audited with the client's key
        r = subprocess.run(numaserve_argv("restart", "--slot", "0", "--wait", *base, "--curve-key", str(client_sec)),
                           capture_output=True, text=True, timeout=120, cwd=str(REPO))
        assert r.returncode == 0, r.stderr
        audit = [json.loads(x) for x in (sup.rt / "audit.log").read_text().splitlines()]
        assert any(a["channel"] == "tcp-curve" and a["who"].get("curve_key") for a in audit), audit


def test_tcp_endpoint_without_keys_is_a_config_error(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[ops]\ntcp_endpoint = "tcp://127.0.0.1:7071"\n')
    r = subprocess.run(numaserve_argv("config", "check", str(cfg)), capture_output=True, text=True, timeout=60,
                       cwd=str(REPO))
    assert r.returncode == 2 and "CURVE" in r.stderr, r.stderr


def test_read_only_socket_refuses_mutations_and_top_streams_stats() -> None:
    from numaserve.control.client import OpsError, OpsTarget, ops_call

    with Running(["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0"]) as sup:
        ro = OpsTarget(runtime_dir=sup.rt, readonly=True)
        assert ops_call(ro, "status")["slots"]
        with pytest.raises(OpsError, match="read-only"):
            ops_call(ro, "stop")
        r = sup.ops("top", "--iterations", "2", "--json", timeout=60)
        assert r.returncode == 0, r.stderr
        rows = [json.loads(x) for x in r.stdout.splitlines()]
        assert len(rows) == 2 and {x["slot"] for x in rows[-1]} == {0, 1}
        assert all(x["state"] == "ready" and x["rss_bytes"] for x in rows[-1])
