"""Serving features through the real `numaserve start`: frames + HTTP on one port, batching,
response cache purge/bump acknowledged by every worker, TLS (with client certs and reload),
allocator environment of the workers."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from numaserve.bind.allocator import find_jemalloc
from numaserve.client import AsyncFrameClient, FrameClient, FrameClientError, Request
from numaserve.framing import HEADER, encode_frame, encode_request

from .harness import FAST_CONFIG, Running

pytestmark = pytest.mark.slow

ONE = ["--nodes", "0", "--workers-per-node", "1", "--bind", "127.0.0.1:0"]
TWO = ["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0"]


def test_http_and_frames_share_the_port_and_bad_frames_leave_the_worker_serving() -> None:
    cfg = FAST_CONFIG + "[framing]\nmax_frame_bytes = 65536\n"
    with Running(ONE, config=cfg) as sup:
        port = sup.port
        assert port is not None
        pid = sup.slots()[0]["pid"]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/healthz")
        assert conn.getresponse().read() == b"ok"
        with FrameClient("127.0.0.1", port, timeout=10) as fc:
            r = fc.request("GET", "/")
            assert r.status == 200 and r.json()["pid"] == pid
            r = fc.request("POST", "/v1/completions", body={"prompt": "hi", "max_tokens": 2})
            assert r.status == 200 and len(r.json()["choices"]) == 1
            rs = fc.pipeline([Request("GET", "/healthz"), Request("GET", "/nope"), Request("GET", "/v1/models")])
            assert [x.status for x in rs] == [200, 404, 200]
        with FrameClient("127.0.0.1", port, timeout=10, encoding="json") as fc:
            fc.send_raw(HEADER.pack(1 << 20) + b'{"id":1')  # over max_frame_bytes
            r = fc.read_response()
            assert r.status == 413 and r.error
            with pytest.raises(FrameClientError):
                fc.read_response()
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(encode_frame(encode_request(1, "GET", "/"))[:-2])  # truncated, then EOF
        s.shutdown(socket.SHUT_WR)
        assert s.recv(100) == b""
        s.close()
        conn.request("GET", "/healthz")  # the same keep-alive HTTP connection still works
        assert conn.getresponse().status == 200
        conn.close()
        with FrameClient("127.0.0.1", port, timeout=10) as fc:
            assert fc.request("GET", "/healthz").status == 200
        slot = sup.slots()[0]
        assert slot["pid"] == pid and slot["restarts"] == 0


def test_batched_embeddings_under_concurrency_match_single_requests() -> None:
    pytest.importorskip("numpy")
    with Running(ONE) as sup:
        port = sup.port
        assert port is not None

        async def one(c: AsyncFrameClient, i: int) -> Any:
            for _ in range(50):  # admission may shed a cold burst with 503: retry like a client should
                r = await c.request("POST", "/v1/embeddings", body={"input": f"text {i % 7}"})
                if r.status != 503:
                    return r
                await asyncio.sleep(0.05)
            return r

        async def main() -> list[Any]:
            async with AsyncFrameClient("127.0.0.1", port) as c:
                return await asyncio.gather(*(one(c, i) for i in range(64)))
        rs = asyncio.run(asyncio.wait_for(main(), 60))
        assert all(r.status == 200 for r in rs), [r.body[:200] for r in rs if r.status != 200]
        with FrameClient("127.0.0.1", port, timeout=10) as fc:
            alone = fc.request("POST", "/v1/embeddings", body={"input": "text 3"}).json()["data"][0]["embedding"]
        batched = rs[3].json()["data"][0]["embedding"]
        assert len(alone) == 256 and max(abs(a - b) for a, b in zip(alone, batched)) < 1e-4


# --- cache ------------------------------------------------------------------------------------

#: keep-alive 60 s, not FAST_CONFIG's 2 s: the tests keep one connection per worker open across a
#: `numaserve cache` CLI call, which took over 2 s on a saturated CI (the server closed the idle
#: connection and the next request met RemoteDisconnected).
CACHE_CONFIG = FAST_CONFIG.replace("keepalive_timeout = 2.0", "keepalive_timeout = 60.0") + """
[cache]
enabled = true
deterministic_paths = ["/v1/embeddings"]
"""


def _connections_per_worker(port: int, n: int) -> dict[int, http.client.HTTPConnection]:
    """One keep-alive connection to each of ``n`` workers (SO_REUSEPORT spreads fresh ones)."""
    out: dict[int, http.client.HTTPConnection] = {}
    for _ in range(200):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/", headers={"Cache-Control": "no-store"})
        pid = json.loads(c.getresponse().read())["pid"]
        if pid in out:
            c.close()
        else:
            out[pid] = c
        if len(out) == n:
            return out
    raise AssertionError(f"reached only workers {sorted(out)}")


def _get(c: http.client.HTTPConnection, path: str, method: str = "GET", body: bytes | None = None) -> str:
    c.request(method, path, body=body)
    r = c.getresponse()
    r.read()
    assert r.status == 200
    return str(r.getheader("x-numaserve-cache"))


def _cache_cli(sup: Running, *args: str) -> tuple[int, str, dict[str, Any] | None]:
    r = sup.ops("cache", *args)
    data = json.loads(r.stdout) if "--json" in args and r.stdout.strip() else None
    return r.returncode, r.stdout + r.stderr, data


def test_cache_purge_and_bump_reach_every_worker_with_acks() -> None:
    with Running(TWO, config=CACHE_CONFIG) as sup:
        assert sup.port is not None
        conns = _connections_per_worker(sup.port, 2)
        for c in conns.values():
            assert _get(c, "/v1/models") == "miss"
            assert _get(c, "/v1/models") == "hit"
            assert _get(c, "/healthz") == "miss"
            emb = b'{"input": "cache me"}'
            assert _get(c, "/v1/embeddings", "POST", emb) == "miss"
            assert _get(c, "/v1/embeddings", "POST", emb) == "hit"

        rc, out, data = _cache_cli(sup, "purge", "--prefix", "/v1/", "--json")
        assert rc == 0 and data is not None, out
        assert data["ok"] and data["workers"] == 2 and not data["failed"]
        assert {a["pid"] for a in data["acks"].values()} == set(conns)
        assert all("purged 2 entries under /v1/" in a["detail"] for a in data["acks"].values()), data
        for c in conns.values():
            assert _get(c, "/v1/models") == "miss"   # purged
            assert _get(c, "/healthz") == "hit"      # outside the prefix: kept

        rc, out, _ = _cache_cli(sup, "bump", "--no-json")
        assert rc == 0 and "cache version 1: 2 workers, 0 without ack" in out, out
        assert out.count(" ok ") == 2
        for c in conns.values():
            assert _get(c, "/healthz") == "miss"     # old version: miss
            assert _get(c, "/healthz") == "hit"

        # a worker that does not answer: reported, and the command fails
        stuck = sorted(conns)[0]
        os.kill(stuck, signal.SIGSTOP)
        try:
            rc, out, _ = _cache_cli(sup, "purge", "--ack-timeout", "1", "--no-json")
        finally:
            os.kill(stuck, signal.SIGCONT)
        assert rc == 1 and "FAILED" in out and "no ack" in out, out
        for c in conns.values():
            c.close()

        # a worker started later gets the current version (sticky)
        r = sup.ops("restart", "--slot", "0", "--wait", timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        sup.wait_for(lambda s: all(x["state"] == "ready" for x in s["slots"]), 30, "ready after restart")
        rc, out, data = _cache_cli(sup, "purge", "--json")
        assert rc == 0 and data is not None and data["workers"] == 2, out
        assert all("(version 1)" in a["detail"] for a in data["acks"].values()), data
        rc, out, _ = _cache_cli(sup, "version", "--no-json")
        assert rc == 0 and out.strip() == "1"


# --- TLS ---------------------------------------------------------------------------------------


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(d: Path, serial: int = 1) -> dict[str, Path]:
    """A CA, a server cert for localhost/127.0.0.1 and a client cert, all signed by the CA."""
    p = {n: d / n for n in ("ca.crt", "ca.key", "srv.crt", "srv.key", "cli.crt", "cli.key")}
    if not p["ca.crt"].exists():
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(p["ca.key"]), "-out",
                 str(p["ca.crt"]), "-days", "1", "-subj", "/CN=numaserve-test-ca")
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name, cn in (("srv", "localhost"), ("cli", "client")):
        csr = d / f"{name}.csr"
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(p[f"{name}.key"]), "-out", str(csr),
                 "-subj", f"/CN={cn}")
        _openssl("x509", "-req", "-in", str(csr), "-CA", str(p["ca.crt"]), "-CAkey", str(p["ca.key"]),
                 "-set_serial", str(serial), "-out", str(p[f"{name}.crt"]), "-days", "1", "-extfile", str(ext))
    return p


def _served_serial(port: int, ctx: ssl.SSLContext) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            der = s.getpeercert(binary_form=True)
    from cryptography import x509

    return int(x509.load_der_x509_certificate(der).serial_number)


def test_tls_with_client_certificates_and_reload_picks_up_renewed_files(tmp_path: Path) -> None:
    import httpx

    pki = make_pki(tmp_path, serial=1)
    cfg = FAST_CONFIG + f"""
[tls]
certfile = "{pki['srv.crt']}"
keyfile = "{pki['srv.key']}"
ca_certs = "{pki['ca.crt']}"
"""
    with Running(ONE, config=cfg) as sup:
        port = sup.port
        assert port is not None
        with_cert = ssl.create_default_context(cafile=str(pki["ca.crt"]))
        with_cert.load_cert_chain(str(pki["cli.crt"]), str(pki["cli.key"]))
        without = ssl.create_default_context(cafile=str(pki["ca.crt"]))

        with httpx.Client(verify=with_cert, timeout=10) as c:
            r = c.get(f"https://localhost:{port}/healthz")
            assert r.status_code == 200 and r.text == "ok"
        with FrameClient("127.0.0.1", port, ssl=with_cert, server_hostname="localhost", timeout=10) as fc:
            assert fc.request("GET", "/healthz").body == b"ok"
        with pytest.raises((httpx.HTTPError, ssl.SSLError, OSError)):
            with httpx.Client(verify=without, timeout=10) as c:
                c.get(f"https://localhost:{port}/healthz")
        with pytest.raises((ssl.SSLError, OSError, FrameClientError)):
            with FrameClient("127.0.0.1", port, ssl=without, server_hostname="localhost", timeout=10) as fc:
                fc.request("GET", "/healthz")
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        with pytest.raises((http.client.HTTPException, OSError)):
            plain.request("GET", "/healthz")
            plain.getresponse()
        plain.close()

        assert _served_serial(port, with_cert) == 1
        make_pki(tmp_path, serial=2)  # renewed in place (same CA)
        r = sup.ops("reload", "--wait", timeout=90)
        assert r.returncode == 0, r.stdout + r.stderr
        sup.wait_for(lambda s: all(x["state"] == "ready" for x in s["slots"]), 30, "ready after reload")
        with_cert = ssl.create_default_context(cafile=str(pki["ca.crt"]))
        with_cert.load_cert_chain(str(pki["cli.crt"]), str(pki["cli.key"]))
        deadline = time.monotonic() + 20
        while _served_serial(port, with_cert) != 2:
            assert time.monotonic() < deadline, "renewed certificate not served after reload"
            time.sleep(0.2)


def test_bad_tls_files_are_a_config_error_at_start(tmp_path: Path) -> None:
    cfg = FAST_CONFIG + f'[tls]\ncertfile = "{tmp_path / "missing.crt"}"\n'
    sup = Running(ONE, config=cfg, expect_ready=False)
    try:
        rc = sup.wait_exit(30)
        err = sup.stderr_path.read_text()
        assert rc == 2 and "tls.certfile" in err and "file not found" in err, err[-2000:]
    finally:
        sup.close()


# --- allocator ------------------------------------------------------------------------------------


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def test_allocator_environment_is_visible_in_the_worker() -> None:
    jemalloc = find_jemalloc()
    cfg = FAST_CONFIG + f"[allocator]\nmalloc_arena_max = 3\njemalloc = {'true' if jemalloc else 'false'}\n"
    with Running(ONE, config=cfg) as sup:
        slot = sup.slots()[0]
        env = _environ(slot["pid"])
        assert env["MALLOC_ARENA_MAX"] == "3" and slot["env"]["MALLOC_ARENA_MAX"] == "3"
        if jemalloc is None:
            pytest.skip("libjemalloc2 not installed: LD_PRELOAD part not checked")
        assert env["LD_PRELOAD"].split()[0] == jemalloc
        assert jemalloc in Path(f"/proc/{slot['pid']}/maps").read_text()


@pytest.mark.parametrize("freeze", [True, False])
def test_gc_freeze_after_app_import(freeze: bool) -> None:
    import json as _json

    from tests.integration.harness import http_get

    cfg = FAST_CONFIG + f"[allocator]\ngc_freeze = {'true' if freeze else 'false'}\n"
    with Running(["--nodes", "0", "--app", "gcapp:app", "--bind", "127.0.0.1:0"], config=cfg) as sup:
        status, body = http_get(sup.port, "/")
        count = _json.loads(body)["freeze_count"]
        assert (count > 1000) if freeze else (count == 0), count
