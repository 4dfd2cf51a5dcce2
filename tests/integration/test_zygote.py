"""Per-node zygotes through the real supervisor: each template generation is forked
from a process that has numaserve's worker stack imported but never the app; a
reload loads the new code; a reload under load loses no request; a zygote's
crash stops nothing and it comes back."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.harness import REPO, Running, http_get, pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _write_app(path: Path, version: str, marks: Path) -> None:
    """An app that leaves a file named after every process that imports it."""
    path.write_text(textwrap.dedent(f"""
        import asyncio, os
        open(os.path.join({str(marks)!r}, str(os.getpid())), "w").close()
        VERSION = {version!r}

        async def app(scope, receive, send):
            if scope["type"] == "lifespan":
                while True:
                    m = await receive()
                    await send({{"type": m["type"] + ".complete"}})
                    if m["type"] == "lifespan.shutdown":
                        return
            n = 6 if scope["path"] == "/sse" else 0
            await send({{"type": "http.response.start", "status": 200,
                         "headers": [(b"content-type", b"text/event-stream" if n else b"text/plain")]}})
            for i in range(n):
                await asyncio.sleep(0.05)
                await send({{"type": "http.response.body", "body": f"data: {{i}}\\n\\n".encode(), "more_body": True}})
            await send({{"type": "http.response.body", "body": (VERSION + " " + str(os.getpid())).encode()}})
    """))


def node(st: dict[str, Any]) -> dict[str, Any]:
    (n,) = st["templates"]["nodes"]
    return n


def forked_from_zygote(st: dict[str, Any]) -> bool:
    n = node(st)
    return n["state"] == "ready" and n["started_by"] == "zygote" and n["zygote"]["state"] == "ready" \
        and all(s["state"] == "ready" and (s["start"] or {}).get("mode") == "fork" for s in st["slots"])


@pytest.fixture()
def app(tmp_path: Path) -> tuple[Path, Path]:
    marks = tmp_path / "imported-by"
    marks.mkdir()
    _write_app(tmp_path / "zygoteapp.py", "v1", marks)
    return tmp_path, marks


def start(app_dir: Path, relative: bool = False) -> Running:
    where = os.path.relpath(app_dir, REPO) if relative else str(app_dir)  # relative to the supervisor's cwd
    return Running(["--nodes", "0", "--bind", "127.0.0.1:0", "--workers-per-node", "2", "--app", "zygoteapp:app",
                    "--app-dir", where])


def importers(marks: Path) -> set[int]:
    return {int(p.name) for p in marks.iterdir()}


def test_templates_are_forked_from_a_zygote_that_never_imports_the_app(app: tuple[Path, Path]) -> None:
    app_dir, marks = app
    with start(app_dir, relative=True) as sup:
        st = sup.wait_for(forked_from_zygote, 30, "template forked from the zygote")
        n = node(st)
        z = n["zygote"]
        assert z["pid"] != n["pid"] and z["templates_forked"] == 1 and z["import_s"] is not None
        assert z["memory"]["pss_bytes"] > 0 and z["running"] is True and z["starts"] == 1
        assert importers(marks) == {n["pid"]}  # the template imported the app; the zygote did not
        _write_app(app_dir / "zygoteapp.py", "v2", marks)
        r = sup.ops("reload", "--wait")
        assert r.returncode == 0, r.stdout + r.stderr
        st2 = sup.wait_for(lambda s: forked_from_zygote(s) and node(s)["generation"] == 2, 30, "generation 2")
        n2 = node(st2)
        assert n2["zygote"]["pid"] == z["pid"] and n2["zygote"]["templates_forked"] == 2
        assert importers(marks) == {n["pid"], n2["pid"]}
        assert all(s["start"]["template_generation"] == 2 for s in st2["slots"])
        for _ in range(10):
            status, body = http_get(sup.port)
            assert status == 200 and body.startswith(b"v2 ")
        op = sup.status()["operations"][-1]
        assert any(s.get("started_by") == "zygote" for s in op["steps"]), op["steps"]
        sup.wait_for(lambda s: not pid_alive(n["pid"]), 10, "old template gone")


def test_a_reload_under_load_loses_no_request(app: tuple[Path, Path]) -> None:
    app_dir, marks = app
    with start(app_dir) as sup:
        sup.wait_for(forked_from_zygote, 30, "forked")
        url = f"http://127.0.0.1:{sup.port}"
        stop = threading.Event()
        results: list[tuple[str, int | str, bytes]] = []
        lock = threading.Lock()

        def client(kind: str) -> None:
            fresh = kind != "keepalive"
            with httpx.Client(timeout=10) as c:
                while not stop.is_set():
                    try:
                        if fresh:
                            r = httpx.get(url + ("/sse" if kind == "sse" else "/"), timeout=10)
                        else:
                            r = c.get(url + "/")
                        out: tuple[str, int | str, bytes] = (kind, r.status_code, r.content)
                    except httpx.HTTPError as e:
                        out = (kind, f"{type(e).__name__}: {e}", b"")
                    with lock:
                        results.append(out)
                    time.sleep(0.01)

        threads = [threading.Thread(target=client, args=(k,), daemon=True)
                   for k in ("fresh", "fresh", "keepalive", "sse", "sse")]
        for t in threads:
            t.start()
        time.sleep(1.0)
        _write_app(app_dir / "zygoteapp.py", "v2", marks)
        r = sup.ops("reload", "--wait")
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(15)
        assert r.returncode == 0, r.stdout + r.stderr
        bad = [x for x in results if x[1] != 200]
        assert not bad, bad[:5]
        versions = [body.rsplit(b"\n", 1)[-1].split()[0] for _, _, body in results]
        assert b"v1" in versions and versions[-1] == b"v2"
        sse = [body for kind, _, body in results if kind == "sse"]
        assert sse and all(b.count(b"data: ") == 6 for b in sse)  # streams in flight ran to their end


def test_zygote_crash_stops_nothing_and_it_comes_back(app: tuple[Path, Path]) -> None:
    app_dir, marks = app
    with start(app_dir) as sup:
        st = sup.wait_for(forked_from_zygote, 30, "forked")
        n = node(st)
        pids = [s["pid"] for s in st["slots"]]
        os.kill(n["zygote"]["pid"], signal.SIGKILL)
        st2 = sup.wait_for(lambda s: node(s)["zygote"]["pid"] not in (None, n["zygote"]["pid"])
                           and node(s)["zygote"]["state"] == "ready", 30, "zygote respawned")
        z2 = node(st2)["zygote"]
        assert z2["starts"] == 2 and z2["last_exit"] and "SIGKILL" in z2["last_exit"]
        assert node(st2)["pid"] == n["pid"] and [s["pid"] for s in st2["slots"]] == pids
        status, body = http_get(sup.port)
        assert status == 200 and body.startswith(b"v1 ")
        assert "zygote_exit" in [e.get("event") for e in sup.events()]
        r = sup.ops("reload", "--wait")
        assert r.returncode == 0, r.stdout + r.stderr
        st3 = sup.wait_for(lambda s: forked_from_zygote(s) and node(s)["generation"] == 2, 30, "generation 2")
        assert node(st3)["zygote"]["pid"] == z2["pid"] and node(st3)["zygote"]["templates_forked"] == 1
        assert z2["pid"] not in importers(marks)
        assert json.dumps(st3["templates"])  # status stays JSON
