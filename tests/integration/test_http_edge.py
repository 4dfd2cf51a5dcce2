"""The HTTP edge with real frameworks and real clients, through the real supervisor.

FastAPI behind numaserve (body limits, websockets across a reload, a failing
lifespan), the demo app through the official ``openai`` client, the RFC
cases on raw sockets, and the operator's terminal (80 columns, a tty).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from typing import Any, Iterator

import httpx
import pytest

from tests.integration.harness import APPS, FAST_CONFIG, REPO, Running, numaserve_argv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

EDGE_CONFIG = FAST_CONFIG.replace("graceful_timeout = 10.0", """graceful_timeout = 10.0
max_body_bytes = 1000
read_timeout = 1.0""")


def raw(port: int, *parts: bytes, pause: float = 0.0, timeout: float = 10.0) -> bytes:
    """Send ``parts`` (``pause`` s apart), then read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        for part in parts:
            s.sendall(part)
            time.sleep(pause)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        return out


def json_error(out: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert headers["content-type"] == "application/json", out[:300]
    return int(lines[0].split()[1]), json.loads(body)["error"]


@pytest.fixture(scope="module")
def fastapi_sup() -> Iterator[Running]:
    with Running(["--app", "edgeapp:app", "--app-dir", str(APPS), "--workers-per-node", "1", "--nodes", "0",
                  "--bind", "127.0.0.1:0"], config=EDGE_CONFIG) as sup:
        yield sup


def test_fastapi_body_over_the_limit_is_413_json_whatever_the_framing(fastapi_sup: Running) -> None:
    url = f"http://127.0.0.1:{fastapi_sup.port}/upload"

    def chunks(n: int, size: int) -> Iterator[bytes]:
        for _ in range(n):
            yield b"x" * size

    with httpx.Client(timeout=10) as c:
        ok = c.post(url, content=b"y" * 900)
        assert ok.status_code == 200 and ok.json()["bytes"] == 900
        for name, content in [("declared", b"y" * 5000), ("chunked", chunks(3, 400)),
                              ("chunked, 4 MB", chunks(64, 65536))]:
            r = c.post(url, content=content)
            assert r.status_code == 413, (name, r.status_code, r.text)
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("too_large", 413) and "server.max_body_bytes" in err["message"]
            assert r.headers["connection"] == "close"
        assert c.post(url, content=chunks(2, 400)).json()["bytes"] == 800  # still serving, chunked
    log = fastapi_sup.log_tail(400)
    assert "Exception in ASGI application" not in log and "Traceback" not in log


def test_fastapi_slow_chunked_body_is_408_json(fastapi_sup: Running) -> None:
    head = (b"POST /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: application/octet-stream\r\n\r\n")
    t0 = time.monotonic()
    out = raw(fastapi_sup.port, head, b"5\r\nhello\r\n")  # ... and the rest never comes
    status, err = json_error(out)
    assert (status, err["type"]) == (408, "read_timeout") and "server.read_timeout" in err["message"]
    assert time.monotonic() - t0 < 8  # the deadline, not the client, ended it
    log = fastapi_sup.log_tail(400)
    assert "Exception in ASGI application" not in log


def test_empty_line_before_the_request_line_is_served(fastapi_sup: Running) -> None:
    """RFC 9112 §2.2 (uvicorn answers these 200 too); not taken for a binary frame."""
    req = b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc"
    for prefix in (b"\r\n", b"\r\n\r\n", b"\n"):
        out = raw(fastapi_sup.port, prefix + req)
        assert out.startswith(b"HTTP/1.1 200"), out[:200]
        assert json.loads(out.partition(b"\r\n\r\n")[2])["bytes"] == 3
    out = raw(fastapi_sup.port, b"\r\n", req, pause=0.2)  # the empty line in a packet of its own
    assert out.startswith(b"HTTP/1.1 200"), out[:200]


def test_protocol_errors_are_json(fastapi_sup: Running) -> None:
    status, err = json_error(raw(fastapi_sup.port, b"GET / HTTP/1.1\r\nHost x\r\n\r\n"))
    assert (status, err["type"]) == (400, "protocol_error")
    status, err = json_error(raw(fastapi_sup.port, b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: "
                                 + b"a" * 100_000 + b"\r\n\r\n"))
    assert (status, err["type"]) == (431, "header_too_large")


def test_websocket_opened_before_reload_gets_its_reply_later(fastapi_sup: Running) -> None:
    """The old worker drains with its websocket open (the drain deadline, as for HTTP
    streams) and answers on it; at the deadline the websocket is closed with 1001."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    url = f"ws://127.0.0.1:{fastapi_sup.port}/ws"
    with connect(url, open_timeout=10) as ws:
        ws.send("before")
        old_pid = json.loads(ws.recv(10))["pid"]
        r = fastapi_sup.ops("reload", "--drain-timeout", "8")
        assert r.returncode == 0, r.stderr
        fastapi_sup.wait_for(lambda s: s["slots"][0]["pid"] not in (None, old_pid)
                             and s["slots"][0]["state"] == "ready", 30, "the new generation")
        time.sleep(4.0)
        ws.send("after reload")
        reply = json.loads(ws.recv(10))
        assert reply == {"echo": "after reload", "pid": old_pid}
        with connect(url, open_timeout=10) as fresh:  # new connections go to the new worker
            fresh.send("new")
            assert json.loads(fresh.recv(10))["pid"] != old_pid
        with pytest.raises(ConnectionClosed) as info:  # the drain deadline (8 s) comes
            ws.recv(20)
        assert info.value.rcvd is not None and info.value.rcvd.code == 1001
    stdout = (fastapi_sup.logdir / "stdout").read_text()
    assert "websocket disconnect code 1001" in stdout and "code 1012" not in stdout


def test_lifespan_file_not_found_is_in_the_one_line_error(tmp_path: Any) -> None:
    missing = tmp_path / "models" / "llama.bin"
    sup = Running(["--app", "edgeapp:app", "--app-dir", str(APPS), "--bind", "127.0.0.1:0"],
                  env={"EDGEAPP_MODEL_PATH": str(missing)}, expect_ready=False)
    try:
        assert sup.wait_exit(60) == 3
        lines = sup.stderr_path.read_text().splitlines()
        error = [line for line in lines if line.startswith("numaserve: error:")]
        expected = ("numaserve: error: no slot could start: lifespan startup failed: FileNotFoundError: "
                    f"[Errno 2] No such file or directory: '{missing}'")
        assert error == [expected], lines[-5:]
        events = sup.events()
        failed = [e for e in events if e.get("event") == "slot_failed"]
        assert failed and all("FileNotFoundError" in e["reason"] for e in failed)
        assert any(e.get("event") == "lifespan_startup_failed" and "FileNotFoundError" in e["error"]
                   for e in events)
    finally:
        sup.close()


def test_lifespan_failure_of_one_slot_is_its_status_reason(tmp_path: Any) -> None:
    missing = tmp_path / "absent.bin"
    with Running(["--app", "edgeapp:app", "--app-dir", str(APPS), "--workers-per-node", "2", "--nodes", "0",
                  "--bind", "127.0.0.1:0"], env={"EDGEAPP_MODEL_PATH": str(missing), "EDGEAPP_FAIL_SLOT": "1"},
                 expect_ready=False) as sup:
        def reason(s: dict[str, Any]) -> str:
            return s["failed_reason"] or s["last_restart_reason"] or ""

        st = sup.wait_for(lambda st: "FileNotFoundError" in reason(st["slots"][1])
                          and st["slots"][0]["state"] == "ready", 60, "slot 0 serving, slot 1's reason")
        assert f"lifespan startup failed: FileNotFoundError: [Errno 2] No such file or directory: '{missing}'" \
            in reason(st["slots"][1])
        r = subprocess.run(numaserve_argv("status", "--no-json", "--runtime-dir", str(sup.rt)), cwd=str(REPO),
                           env=dict(os.environ, COLUMNS="80"), capture_output=True, text=True, timeout=30)
        text = " ".join(line.strip() for line in r.stdout.splitlines())
        assert "FileNotFoundError: [Errno 2] No such file or directory" in text and "Traceback" not in text


# --- the demo app: OpenAI clients, the operator's terminal ------------------------------------


@pytest.fixture(scope="module")
def demo_sup() -> Iterator[Running]:
    config = FAST_CONFIG.replace('format = "json"', 'format = "auto"')
    with Running(["--workers-per-node", "2", "--nodes", "0", "--bind", "127.0.0.1:0"], config=config,
                 tty_stderr=True) as sup:
        yield sup


def test_openai_client_streams_chat_and_completions(demo_sup: Running) -> None:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{demo_sup.port}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["numaserve-demo"]
    messages = [{"role": "user", "content": "tell me about NUMA"}]

    arrivals: list[float] = []
    pieces: list[str] = []
    stream = client.chat.completions.create(model="numaserve-demo", messages=messages, max_tokens=64,
                                            stream=True, stream_options={"include_usage": True})
    usage = None
    finish = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
                arrivals.append(time.monotonic())
            finish = choice.finish_reason or finish
    assert len(pieces) == 64 and finish == "length"
    assert arrivals[0] < arrivals[-1]  # chunks came over time, as they were generated
    assert usage is not None and usage.completion_tokens == 64 and usage.total_tokens == usage.prompt_tokens + 64
    plain = client.chat.completions.create(model="numaserve-demo", messages=messages, max_tokens=64)
    assert plain.choices[0].message.content == "".join(pieces) and plain.object == "chat.completion"

    texts = [c.choices[0].text for c in client.completions.create(model="numaserve-demo", prompt="numa",
                                                                 max_tokens=16, stream=True) if c.choices]
    assert len([t for t in texts if t]) == 16
    assert "".join(texts) == client.completions.create(model="numaserve-demo", prompt="numa",
                                                       max_tokens=16).choices[0].text
    emb = client.embeddings.create(model="numaserve-demo", input=["a", "b"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 256

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="numaserve-demo", messages=messages, max_tokens=0)
    assert info.value.status_code == 400 and info.value.body["param"] == "max_tokens"


def test_status_fits_80_columns(demo_sup: Running) -> None:
    env = dict(os.environ, COLUMNS="80")
    r = subprocess.run(numaserve_argv("status", "--no-json", "--runtime-dir", str(demo_sup.rt)), env=env,
                       capture_output=True, text=True, timeout=30, cwd=str(REPO))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), r.stdout
    slot_lines = [line for line in lines if line[:4].strip().isdigit()]
    assert len(slot_lines) == 2 and all("ready" in line for line in slot_lines)
    if shutil.which("tmux"):  # and on a real 80-column terminal
        session = f"ns-edge-{os.getpid()}"
        cmd = " ".join(numaserve_argv("status", "--runtime-dir", str(demo_sup.rt)))
        subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "30",
                        f"cd {REPO} && {cmd}; sleep 30"], check=True, env={**os.environ, "COLUMNS": ""})
        try:
            screen = ""
            for _ in range(100):
                screen = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                                        text=True).stdout
                if "ready" in screen:
                    break
                time.sleep(0.1)
            rows = [line for line in screen.splitlines() if line[:4].strip().isdigit()]
            assert len(rows) == 2 and all("ready" in row and "…" not in row for row in rows), screen
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_worker_logs_on_a_tty_are_console_lines(demo_sup: Running) -> None:
    lines = [line for line in demo_sup.stderr_path.read_text(errors="replace").splitlines() if line.strip()]
    worker = [line for line in lines if "numaserve.worker" in line]
    assert worker, lines[:20]
    assert not any(line.lstrip().startswith("{") for line in lines), [x for x in lines if "{" in x][:3]
    assert any(" ready " in line or "ready " in line for line in worker)
