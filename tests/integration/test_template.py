"""Warm per-node templates through the real supervisor: forked workers serve real
traffic (FastAPI, SSE), are replaced after kill -9, survive their template's crash,
keep serving through a reload with broken code, and a threaded template falls
back to exec."""

from __future__ import annotations

import json
import os
import signal
import textwrap
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.integration.harness import APPS, FAST_CONFIG, Running, http_get, pid_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

BASE = ["--nodes", "0", "--bind", "127.0.0.1:0", "--app-dir", str(APPS)]


def templates(st: dict[str, Any]) -> list[dict[str, Any]]:
    return st["templates"]["nodes"]


def all_forked(st: dict[str, Any]) -> bool:
    return bool(st["slots"]) and all(s["state"] == "ready" and (s["start"] or {}).get("mode") == "fork"
                                     for s in st["slots"])


def get_json(port: int, path: str = "/") -> dict[str, Any]:
    status, body = http_get(port, path)
    assert status == 200, (status, body[:300])
    return json.loads(body)


def seen_workers(port: int, want: int, tries: int = 200) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for _ in range(tries):
        d = get_json(port)
        out[d["pid"]] = d
        if len(out) >= want:
            break
    return out


@pytest.fixture(scope="module")
def forked() -> Iterator[Running]:
    with Running([*BASE, "--workers-per-node", "2", "--app", "templateapp:app", "--preload", "templateapp:load"],
                 env={"TEMPLATEAPP_PRELOAD_MB": "8"}) as sup:
        sup.wait_for(all_forked, 30, "both slots forked from the template")
        yield sup


def test_forked_workers_serve_fastapi_and_sse_with_the_preloaded_state(forked: Running) -> None:
    st = forked.status()
    (t,) = templates(st)
    assert t["state"] == "ready" and t["generation"] == 1 and t["pid"]
    assert t["preload_s"] is not None and t["memory"]["pss_bytes"] > 0 and t["memory"]["shared_bytes"] > 0
    for s in st["slots"]:
        assert s["start"] == {"mode": "fork", "template_pid": t["pid"], "template_generation": 1, "node": 0}
        assert s["binding_verified"] is True, s["binding_problems"]
    workers = seen_workers(forked.port, 2)
    assert len(workers) == 2
    for pid, d in workers.items():
        # imported and preloaded once, in the template; served by the forked worker, a child of the supervisor
        assert d["imported_by"] == t["pid"] and d["preload_pid"] == t["pid"] and d["weights_bytes"] == 8 << 20
        assert d["ppid"] == st["supervisor"]["pid"]
        slot = next(s for s in st["slots"] if s["pid"] == pid)
        assert d["slot"] == str(slot["slot"]) and d["cpus"] == slot["cpus"]
    with httpx.Client(timeout=10) as c:
        for _ in range(4):
            with c.stream("GET", f"http://127.0.0.1:{forked.port}/sse?n=8") as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and [e.split()[0] for e in events[:-1]] == [f"token-{i}" for i in range(8)]
            assert int(events[0].split("pid=")[1]) in workers


def test_kill9_of_a_forked_worker_is_replaced_by_a_fork(forked: Running) -> None:
    st = forked.status()
    victim = st["slots"][0]
    tpid = templates(st)[0]["pid"]
    os.kill(victim["pid"], signal.SIGKILL)
    st2 = forked.wait_for(lambda s: s["slots"][0]["pid"] not in (None, victim["pid"]) and all_forked(s), 30,
                          "slot 0 replaced")
    new = st2["slots"][0]
    assert new["start"]["template_pid"] == tpid and new["restarts"] == victim["restarts"] + 1
    assert st2["slots"][1]["pid"] == st["slots"][1]["pid"]  # the other slot untouched
    assert not pid_alive(victim["pid"])
    forked.wait_for(lambda s: s["slots"][0]["binding_verified"] is True, 10, "new worker verified")
    assert new["pid"] in seen_workers(forked.port, 2)


def test_template_crash_keeps_workers_serving_and_is_respawned(forked: Running) -> None:
    st = forked.status()
    (t,) = templates(st)
    pids = [s["pid"] for s in st["slots"]]
    os.kill(t["pid"], signal.SIGKILL)
    st2 = forked.wait_for(lambda s: templates(s)[0]["pid"] not in (None, t["pid"])
                          and templates(s)[0]["state"] == "ready", 30, "template respawned")
    t2 = templates(st2)[0]
    assert t2["generation"] == t["generation"] + 1 and t2["restarts"] >= 1
    assert t2["last_exit"] and "SIGKILL" in t2["last_exit"]
    assert [s["pid"] for s in st2["slots"]] == pids  # its workers were never its children
    assert all(s["state"] == "ready" for s in st2["slots"])
    assert set(seen_workers(forked.port, 2)) == set(pids)
    # a worker that dies now is forked from the new template
    os.kill(pids[1], signal.SIGKILL)
    st3 = forked.wait_for(lambda s: s["slots"][1]["pid"] not in (None, pids[1]) and all_forked(s), 30,
                          "slot 1 replaced from the new template")
    assert st3["slots"][1]["start"]["template_pid"] == t2["pid"]
    events = [e.get("event") for e in forked.events()]
    assert "template_exit" in events


def test_threaded_template_refuses_to_fork_and_workers_are_execd() -> None:
    with Running([*BASE, "--workers-per-node", "2", "--app", "threadedapp:app"]) as sup:
        st = sup.wait_for(lambda s: all(x["state"] == "ready" for x in s["slots"]), 30, "slots ready")
        (t,) = templates(st)
        assert t["state"] == "refused"
        assert any("app-poller" in th and "threadedapp" in th for th in t["threads"]), t["threads"]
        assert "threads" in t["reason"]
        for s in st["slots"]:
            assert s["start"] == {"mode": "exec"} and s["binding_verified"] is True
        d = get_json(sup.port)
        assert d["threads"] >= 2
        ev = sup.events()
        refused = [e for e in ev if e.get("event") == "fork_refused"]
        assert refused and refused[0]["fallback"] == "exec" and "app-poller" in json.dumps(refused[0]["threads"])
        assert any(e.get("event") == "spawn_exec_fallback" and "threads" in e.get("reason", "") for e in ev)
        # the refused template's channel is closed once, not read again ("Bad file descriptor")
        assert not [e for e in ev if e.get("event") == "template_bad_message"], ev


def _write_app(path: Path, version: str, broken: bool = False) -> None:
    body = 'raise RuntimeError("reloadapp: broken on purpose")\n' if broken else ""
    path.write_text(textwrap.dedent(f"""
        import os
        {body}
        VERSION = {version!r}

        async def app(scope, receive, send):
            if scope["type"] == "lifespan":
                while True:
                    m = await receive()
                    await send({{"type": m["type"] + ".complete"}})
                    if m["type"] == "lifespan.shutdown":
                        return
            await send({{"type": "http.response.start", "status": 200, "headers": []}})
            await send({{"type": "http.response.body", "body": (VERSION + " " + str(os.getpid())).encode()}})
    """))


def test_reload_with_broken_app_keeps_old_template_and_workers(tmp_path: Path) -> None:
    mod = tmp_path / "reloadapp.py"
    _write_app(mod, "v1")
    with Running(["--nodes", "0", "--bind", "127.0.0.1:0", "--workers-per-node", "2", "--app", "reloadapp:app",
                  "--app-dir", str(tmp_path)]) as sup:
        st = sup.wait_for(all_forked, 30, "forked")
        t1 = templates(st)[0]
        pids = [s["pid"] for s in st["slots"]]
        _write_app(mod, "v2", broken=True)
        r = sup.ops("reload", "--wait")
        assert r.returncode != 0, r.stdout
        out = r.stdout + r.stderr
        assert "reloadapp: broken on purpose" in out and "old worker kept serving" in out, out
        st2 = sup.status()
        assert templates(st2)[0]["pid"] == t1["pid"] and templates(st2)[0]["state"] == "ready"
        assert [s["pid"] for s in st2["slots"]] == pids and all(s["state"] == "ready" for s in st2["slots"])
        for _ in range(10):
            status, body = http_get(sup.port)
            assert status == 200 and body.startswith(b"v1 ")
        _write_app(mod, "v3")
        r = sup.ops("reload", "--wait")
        assert r.returncode == 0, r.stdout + r.stderr
        st3 = sup.wait_for(all_forked, 30, "rolled")
        t3 = templates(st3)[0]
        assert t3["generation"] == t1["generation"] + 2 and t3["pid"] != t1["pid"]
        assert all(s["start"]["template_generation"] == t3["generation"] for s in st3["slots"])
        assert not set(pids) & {s["pid"] for s in st3["slots"]}
        for _ in range(10):
            status, body = http_get(sup.port)
            assert status == 200 and body.startswith(b"v3 ")
        sup.wait_for(lambda s: not pid_alive(t1["pid"]), 10, "old template gone")


def test_exec_mode_runs_the_preload_hook_in_every_worker() -> None:
    cfg = FAST_CONFIG + '\n[worker]\nstart = "exec"\npreload = "templateapp:load"\n'
    with Running([*BASE, "--workers-per-node", "2", "--app", "templateapp:app"], config=cfg) as sup:
        st = sup.status()
        assert st["templates"]["nodes"] == [] and st["templates"]["start"] == "exec"
        for pid, d in seen_workers(sup.port, 2).items():
            assert d["preload_pid"] == pid and d["imported_by"] == pid and d["weights_bytes"] == 4 << 20
        assert all(s["start"] == {"mode": "exec"} for s in st["slots"])


def test_failing_preload_is_a_boot_failure_with_its_reason(tmp_path: Path) -> None:
    (tmp_path / "badpreload.py").write_text("def load():\n    raise MemoryError('no room for the weights')\n")
    sup = Running([*BASE, "--workers-per-node", "1", "--app", "templateapp:app", "--preload", "badpreload:load",
                   "--app-dir", str(tmp_path)], expect_ready=False)
    try:
        rc = sup.wait_exit(60)
        err = sup.stderr_path.read_text()
        assert rc == 3 and "no room for the weights" in err, err[-3000:]
    finally:
        sup.close()


def test_forked_worker_gets_its_slots_own_environment() -> None:
    cfg = FAST_CONFIG + '\n[env]\nvars = { SHARD = "s{slot}-n{node}-c{ncpus}" }\n[env.slot."1"]\nONLY_ONE = "yes"\n'
    names = "SHARD,ONLY_ONE,NUMASERVE_SLOT,NUMASERVE_CPUS,OMP_NUM_THREADS,NUMASERVE_TOKEN_FD,NUMASERVE_TEMPLATE_SPEC"
    with Running([*BASE, "--workers-per-node", "2", "--app", "templateapp:app"], config=cfg,
                 env={k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}) as sup:
        st = sup.wait_for(all_forked, 30, "forked")
        by_pid = {s["pid"]: s for s in st["slots"]}
        seen: dict[int, dict[str, Any]] = {}
        for _ in range(200):
            d = get_json(sup.port, f"/env?names={names}")
            seen[d["pid"]] = d["env"]
            if len(seen) == 2:
                break
        assert set(seen) == set(by_pid)
        for pid, e in seen.items():
            s = by_pid[pid]
            n = len(s["cpus"])
            assert e["SHARD"] == f"s{s['slot']}-n0-c{n}" and e["NUMASERVE_SLOT"] == str(s["slot"])
            assert (e["ONLY_ONE"] == "yes") == (s["slot"] == 1) and e["OMP_NUM_THREADS"] == str(n)
            assert e["NUMASERVE_TOKEN_FD"] is None and e["NUMASERVE_TEMPLATE_SPEC"] is None
