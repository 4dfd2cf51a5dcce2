"""numaserve.service under a real systemd (PID 1 of the 2-node lab VM, systemd 252).

Installed the way README says: ``numaserve systemd install`` from a venv in
/opt/numaserve (pip-installed from the wheel on the host, bind-mounted here;
its dependencies are the host's, bind-mounted read-only at /opt/numaserve-deps
because the VM has no network), an operator's edits to the config,
``systemd-sysusers``, ``daemon-reload``, ``systemctl start``.  So the real
``User=numaserve`` and the unit's whole sandbox are what run.

The tests run in file order against one service instance (start → checks →
reloads → OOM → watchdog → stop → AllowedCPUs restart).  Measurements go to
``$NUMASERVE_SD_SHARE/timings.json`` for the host.  Never assert durations:
TCG on a shared 2-core host makes them meaningless; ordering and outcomes are
what is asserted.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any


import sdlab as L
from sdlab import UNIT

APPS = Path(__file__).resolve().parent / "apps"
NODE_ROOT = Path("/sys/devices/system/node")
CGROUP = Path("/sys/fs/cgroup/system.slice") / UNIT
IRQ_STATE = Path("/var/lib/numaserve/irq-saved.json")
STATE: dict[str, Any] = {}   # carried from one (ordered) test to the next


def node_cpus() -> dict[int, set[int]]:
    from numaserve.cpulist import parse_list

    nodes = parse_list((NODE_ROOT / "online").read_text())
    return {n: set(parse_list((NODE_ROOT / f"node{n}" / "cpulist").read_text())) for n in nodes}


def ev(entry: dict[str, Any]) -> dict[str, Any]:
    """numaserve's event from a journal entry's MESSAGE (the JSON line), {} for other lines."""
    msg = L.field_text(entry.get("MESSAGE"))
    if not msg.startswith("{"):
        return {}
    try:
        return json.loads(msg)
    except ValueError:
        return {}


def named(entries: list[dict[str, Any]], name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(e, d) for e in entries if (d := ev(e)).get("event") == name]


def main_pid() -> int:
    return int(L.show("MainPID")["MainPID"])


def notifications(entries: list[dict[str, Any]], pid: int) -> list[tuple[float, str]]:
    """PID 1's debug lines "Got notification message from PID <pid> (...)": (time, fields)."""
    out = []
    for t, m in L.pid1_lines(entries, f"Got notification message from PID {pid} ("):
        out.append((t, m.split(" (", 1)[1].rstrip(")")))
    return out


def nic_irqs() -> tuple[Any, set[int], set[int]]:
    from numaserve.topology import discover

    topo = discover("/")
    nics = [n for n in topo.nics if n.numa_node is not None and any(i.kind == "queue" for i in n.irqs)]
    assert nics, [(n.name, n.numa_node) for n in topo.nics]
    nic = nics[0]
    return nic, {i.irq for i in nic.irqs if i.kind == "queue"}, {i.irq for i in nic.irqs if i.kind != "queue"}


def affinity(irq: int) -> str:
    return Path(f"/proc/irq/{irq}/smp_affinity_list").read_text().strip()


def edit_config(replacements: dict[str, str]) -> None:
    """An operator's edits to the installed example config: each ``key = default`` line must be there
    once; the shipped file has it commented out (``# key = default``), and the edit sets it."""
    L.CONFIG.write_text(set_lines(L.CONFIG.read_text(), replacements))


def set_lines(text: str, replacements: dict[str, str]) -> str:
    """``text`` with each ``old`` line (commented out or not) replaced by ``new``, uncommented."""
    for old, new in replacements.items():
        assert text.count(old) == 1, f"{old!r} appears {text.count(old)} times in {L.CONFIG}"
        text = text.replace("# " + old if "# " + old in text else old, new)
    return text


def wait_serving(expect_nodes: set[int], timeout: float = 300) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        p = L.show("ActiveState", "SubState", "StatusText", "MainPID", "NRestarts")
        if p["ActiveState"] != "active" or p["SubState"] != "running":
            return None
        try:
            st = L.status()
        except AssertionError:
            return None
        if {s["node"] for s in st["slots"]} == expect_nodes and all(s["state"] == "ready" for s in st["slots"]):
            return {"unit": p, "status": st}
        return None

    return L.wait_for("the unit active/running with every slot ready", ready, timeout=timeout, step=1.0)


# ------------------------------------------------------------------ install, start


def test_install_the_readme_way() -> None:
    stage, deps = Path(os.environ["NUMASERVE_SD_STAGE"]), os.environ["NUMASERVE_SD_DEPS"]
    for src, dst in ((stage / "numaserve", L.PREFIX), (Path(deps), L.DEPS)):
        dst.mkdir(parents=True, exist_ok=True)
        L.run(["mount", "--bind", str(src), str(dst)])
    out = json.loads(L.ns("systemd", "install", "--json").stdout)
    assert out["exec"] == L.NUMASERVE, out          # this installation's numaserve, not $PATH's
    assert {Path(f["path"]).name: f["action"] for f in out["files"]} == {
        "numaserve.service": "create", "numaserve.conf": "create", "numaserve.toml": "create"}, out
    assert out["warnings"] == [] and out["next_steps"][0] == "systemd-sysusers", out
    unit = Path("/etc/systemd/system/numaserve.service").read_text()
    assert f"ExecStart={L.NUMASERVE} start --config /etc/numaserve/numaserve.toml" in unit
    assert f"ExecReload={L.NUMASERVE} reload --wait" in unit
    assert "\nUser=numaserve\n" in unit and "\nProtectHome=yes\n" in unit and "\nProtectSystem=strict\n" in unit

    # the app, where the numaserve user can read it
    L.APP_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copy(APPS / "sdapp.py", L.APP_DIR / "sdapp.py")
    os.chmod(L.APP_DIR, 0o755)
    os.chmod(L.APP_DIR / "sdapp.py", 0o644)
    # the operator's edits; TCG: a worker takes 10-30 s to boot, so a longer heartbeat timeout
    # (supervisor.ready_timeout: no deadline by default)
    edit_config({
        'bind = ["0.0.0.0:8000"]': f'bind = ["127.0.0.1:{L.PORT}"]',
        'app = ""': 'app = "sdapp:app"',
        'app_dir = ""': f'app_dir = "{L.APP_DIR}"',
        "heartbeat_timeout = 10.0": "heartbeat_timeout = 60.0",
    })
    L.ns("config", "check", str(L.CONFIG))
    # NIC IRQ steering: the unit's commented privileged lines, uncommented in a drop-in
    lines = [ln[1:] for ln in unit.splitlines() if ln.startswith(("#ExecStartPre=-+", "#ExecStopPost=-+"))]
    assert len(lines) == 2 and all(L.NUMASERVE in ln for ln in lines), lines
    L.DROPINS.mkdir(parents=True, exist_ok=True)
    (L.DROPINS / "20-irq.conf").write_text("[Service]\n" + "\n".join(lines) + "\n")

    L.run(["systemd-sysusers"])
    user = pwd.getpwnam("numaserve")
    assert 0 < user.pw_uid < 1000, user        # a system user
    L.systemctl("daemon-reload")
    p = L.show("LoadState", "User", "Type", "NotifyAccess", "OOMPolicy", "DropInPaths")
    assert p["LoadState"] == "loaded" and p["User"] == "numaserve" and p["Type"] == "notify", p
    assert p["OOMPolicy"] == "continue" and "20-irq.conf" in p["DropInPaths"], p
    nic, queue, admin = nic_irqs()
    STATE["irq_before"] = {i: affinity(i) for i in sorted(queue | admin)}
    STATE["uid"] = user.pw_uid


def test_start_returns_only_when_every_slot_is_ready() -> None:
    t0 = L.mono()
    L.systemctl("start", UNIT)
    t1 = L.mono()
    p = L.show("ActiveState", "SubState", "StatusText", "MainPID", "NRestarts", "ActiveEnterTimestampMonotonic",
               "ExecMainStartTimestampMonotonic", "WatchdogUSec")
    assert (p["ActiveState"], p["SubState"], p["NRestarts"], p["WatchdogUSec"]) == ("active", "running", "0", "30s"), p
    assert p["StatusText"] == "running: node0 1/1 ready; node1 1/1 ready", p
    active_at = int(p["ActiveEnterTimestampMonotonic"]) / 1e6
    assert t0 < int(p["ExecMainStartTimestampMonotonic"]) / 1e6 < active_at <= t1, (t0, p, t1)
    st = L.status_cli()
    assert st["supervisor"]["pid"] == int(p["MainPID"])
    assert sorted((s["node"], s["state"]) for s in st["slots"]) == [(0, "ready"), (1, "ready")], st["slots"]
    # forked from each node's template, inside the unit's sandbox (seccomp, no new privileges)
    assert all(s["start"]["mode"] == "fork" and s["start"]["node"] == s["node"] for s in st["slots"]), st["slots"]
    # systemd went active only after the last slot reported ready
    ready = named(L.journal(since=t0), "worker_ready")
    assert {d["slot"] for _, d in ready} == {0, 1}, ready
    assert max(L.ts(e) for e, _ in ready) <= active_at, ([L.ts(e) for e, _ in ready], active_at)
    code, body = L.http_get("/readyz", port=L.ADMIN_PORT)
    assert code == 200, body
    code, body = L.http_get("/")
    assert code == 200 and json.loads(body)["pid"] in {s["pid"] for s in st["slots"]}, body
    # the unprivileged user under the sandbox, supervisor and workers alike
    for pid in [int(p["MainPID"]), *(s["pid"] for s in st["slots"])]:
        ps = L.proc_status(pid)
        assert ps["Uid"].split()[:2] == [str(STATE["uid"])] * 2, (pid, ps["Uid"])
        assert ps["NoNewPrivs"] == "1" and ps["Seccomp"] == "2" and int(ps["CapEff"], 16) == 0, (pid, ps)
    L.record("start", {"systemctl_start_s": round(t1 - t0, 2),
                       "worker_boot_s": sorted(d["boot_s"] for _, d in ready)})


def test_journal_carries_structured_fields() -> None:
    main = main_pid()
    workers = {str(s["pid"]) for s in L.status()["slots"]}
    j = L.journal()
    spawn = [e for e in j if e.get("_PID") == str(main) and e.get("EVENT") == "spawn"]
    assert {e.get("SLOT") for e in spawn} == {"0", "1"}, [(e.get("SLOT"), e.get("MESSAGE")) for e in spawn]
    for e in spawn:
        assert e["PRIORITY"] == "6" and e["SYSLOG_IDENTIFIER"] == "numaserve" and e["_SYSTEMD_UNIT"] == UNIT, e
        assert e["NODE"] in ("0", "1") and e["PROCESS"] == "supervisor" and e["CPUS"].startswith("["), e
        assert ev(e)["event"] == "spawn" and ev(e)["slot"] == int(e["SLOT"])  # MESSAGE is still the JSON line
    wk = [e for e in j if e.get("_PID") in workers and "EVENT" in e]
    assert wk, "no structured worker lines"
    assert {e.get("PROCESS") for e in wk} == {"worker-0", "worker-1"}, {e.get("PROCESS") for e in wk}
    assert all(e.get("SLOT") in ("0", "1") and e.get("GENERATION") for e in wk), wk[:3]
    # journalctl can select on them
    out = L.run(["journalctl", "-b", "-u", UNIT, "EVENT=worker_ready", "SLOT=1", "-o", "json", "--no-pager"]).stdout
    sel = [json.loads(x) for x in out.splitlines() if x.strip()]
    assert sel and all(x["EVENT"] == "worker_ready" and x["SLOT"] == "1" for x in sel), sel


def test_binding_works_inside_the_sandbox() -> None:
    from numaserve.bind.verify import check_placement, read_placement

    cpus = node_cpus()
    st = L.status()
    for s in st["slots"]:
        assert s["binding_verified"] is True, s
        obs = read_placement(s["pid"])
        assert len(obs.threads) >= 3, obs.threads          # main + the app's helper threads (+ loop helpers)
        assert all(set(t.cpus) <= cpus[s["node"]] for t in obs.threads), (s["node"], obs.threads)
    s1 = next(s for s in st["slots"] if s["node"] == 1)
    obs = read_placement(s1["pid"])
    ok, problems = check_placement(obs, cpus=sorted(cpus[1]), mempolicy="bind", nodes=[1], require_static=True)
    assert ok, problems
    assert all(t.policy in (None, "bind=static:1") for t in obs.threads), obs.threads
    assert any(t.policy == "bind=static:1" for t in obs.threads), obs.threads


def test_irq_steering_by_the_privileged_step() -> None:
    from numaserve.cpulist import parse_list

    nic, queue, admin = nic_irqs()
    local = node_cpus()[nic.numa_node]
    now = {i: affinity(i) for i in sorted(queue | admin)}
    targets = {i: set(parse_list(now[i])) for i in queue}
    assert all(len(t) == 1 and t <= local for t in targets.values()), (nic.numa_node, now)
    assert set().union(*targets.values()) == local, now          # spread over the node's CPUs
    assert {i: now[i] for i in admin} == {i: STATE["irq_before"][i] for i in admin}
    assert IRQ_STATE.exists() and IRQ_STATE.stat().st_uid == 0   # written by the "+" (root) step
    assert main_pid() and L.proc_status(main_pid())["Uid"].split()[0] != "0"


# ------------------------------------------------------------------------ reload


def _reload_op(after_ids: set[str]) -> dict[str, Any]:
    ops = [o for o in L.operations() if o["kind"] == "reload" and o["id"] not in after_ids]
    assert len(ops) == 1, ops
    return ops[0]


def test_reload_under_load_is_what_the_unit_shows() -> None:
    main = main_pid()
    before = {s["slot"]: s for s in L.status()["slots"]}
    seen_ops = {o["id"] for o in L.operations()}
    load = L.Load(threads=2).start()
    L.wait_for("load flowing", lambda: len(load.ok()) >= 20, timeout=120)
    slow, threads = L.fire(["/slow?s=3"] * 4)       # in flight when the reload begins
    time.sleep(1.0)
    L.systemctl("log-level", "debug")
    t0 = L.mono()
    try:
        L.systemctl("reload", UNIT)
        t1 = L.mono()
        p = L.show("ActiveState", "SubState", "MainPID", "NRestarts", "StatusText")
    finally:
        L.systemctl("log-level", "info")
    time.sleep(2.0)                                 # some traffic on the new generation
    load.stop()
    for t in threads:
        t.join(120)
    # `systemctl reload` returned when the reload had ended, and the unit was back to active/running
    assert (p["ActiveState"], p["SubState"], p["MainPID"], p["NRestarts"]) == ("active", "running", str(main), "0"), p
    assert p["StatusText"] == "running: node0 1/1 ready; node1 1/1 ready", p
    op = _reload_op(seen_ops)
    assert op["state"] == "succeeded", op
    after = {s["slot"]: s for s in L.status()["slots"]}
    for slot, s in after.items():
        assert s["state"] == "ready" and s["generation"] == before[slot]["generation"] + 1, (before, after)
    # nothing lost: no failed request, the in-flight ones finished, both generations served
    assert load.failed() == [], load.failed()[:10]
    shed = load.shed()
    assert len(shed) <= 0.05 * len(load.outcomes), f"{len(shed)} of {len(load.outcomes)} shed by admission"
    assert [o.status for o in slow] == [200] * 4, slow
    pids = {o.pid for o in load.ok()}
    assert {s["pid"] for s in before.values()} & pids and {s["pid"] for s in after.values()} & pids, pids
    # the protocol as PID 1 saw it
    j = L.journal(since=t0 - 0.5)
    notes = notifications(j, main)
    rel = [(t, f) for t, f in notes if f.startswith("RELOADING=1")]
    assert len(rel) == 1, notes
    usec = int(re.search(r"MONOTONIC_USEC=(\d+)", rel[0][1]).group(1))
    assert t0 <= usec / 1e6 <= rel[0][0], (t0, usec, rel)       # when it was asked, on PID 1's clock
    rdy = [(t, f) for t, f in notes if f.startswith("READY=1") and t > rel[0][0]]
    assert rdy and "running: node0 1/1 ready; node1 1/1 ready" in rdy[0][1], notes
    control_exit = L.pid1_lines(j, "Control process exited, code=exited, status=0")
    back = L.pid1_lines(j, "Changed reload -> running")
    to_reload = L.pid1_lines(j, "Changed running -> reload")
    assert to_reload and control_exit and back, (to_reload, control_exit, back)
    assert to_reload[0][0] <= rel[0][0] < rdy[0][0] <= control_exit[-1][0] <= back[-1][0] <= t1, \
        (to_reload, rel, rdy, control_exit, back, t1)
    assert L.pid1_lines(j, "Reloaded numaserve.service")
    L.record("reload_under_load", {
        "systemctl_reload_s": round(t1 - t0, 2),
        "unit_reloading_s": round(back[-1][0] - to_reload[0][0], 2),
        "RELOADING_to_READY_s": round(rdy[0][0] - rel[0][0], 2),
        "READY_to_running_s": round(back[-1][0] - rdy[0][0], 3),
        "op_steps": [(s["t"], s["message"]) for s in op["steps"]],
        "requests_ok": len(load.ok()),
    })


def test_refused_reload_keeps_serving_with_the_reason_in_the_journal() -> None:
    main = main_pid()
    gens = {s["slot"]: s["generation"] for s in L.status()["slots"]}
    good = L.CONFIG.read_text()
    L.CONFIG.write_text(set_lines(good, {"graceful_timeout = 30.0": 'graceful_timeout = "soon"'}))
    try:
        t0 = L.mono()
        r = L.systemctl("reload", UNIT, check=False)
    finally:
        L.CONFIG.write_text(good)
    assert r.returncode != 0 and "failed" in r.stderr, (r.returncode, r.stderr)
    p = L.show("ActiveState", "SubState", "MainPID", "StatusText")
    assert (p["ActiveState"], p["SubState"], p["MainPID"]) == ("active", "running", str(main)), p
    assert "reload refused" in p["StatusText"], p
    st = L.status()
    assert {s["slot"]: s["generation"] for s in st["slots"]} == gens and all(s["state"] == "ready" for s in st["slots"])
    j = L.journal(since=t0)
    refused = [e for e in j if e.get("EVENT") == "reload_refused"]
    assert refused and "graceful_timeout" in refused[0]["REASON"] and refused[0]["PRIORITY"] == "3", refused
    said = [m for _, m in L.messages(j) if "reload refused" in m and "graceful_timeout" in m]
    assert len(said) >= 2, said          # the supervisor's event and the reload command's error
    assert L.pid1_lines(j, "Control process exited, code=exited, status=")
    assert L.http_get("/")[0] == 200


# ------------------------------------------------------------------ OOM, watchdog


def test_oom_killed_worker_is_restarted_and_the_unit_stays_up() -> None:
    main = main_pid()
    n0 = L.show("NRestarts")["NRestarts"]
    before = {s["slot"]: s for s in L.status()["slots"]}
    ooms = int(dict(x.split() for x in (CGROUP / "memory.events").read_text().splitlines())["oom_kill"])
    limit = int((CGROUP / "memory.current").read_text()) + (96 << 20)
    L.systemctl("set-property", "--runtime", UNIT, f"MemoryMax={limit}", "MemorySwapMax=0")
    try:
        t0 = L.mono()
        outs, threads = L.fire(["/alloc?mb=400"])
        for t in threads:
            t.join(180)
        L.wait_for("an OOM kill in the unit's cgroup", lambda: int(dict(
            x.split() for x in (CGROUP / "memory.events").read_text().splitlines())["oom_kill"]) > ooms, timeout=60)
        assert outs and outs[0].status != 200, outs   # its connection died with the worker
        got = wait_serving({0, 1})
    finally:
        L.systemctl("set-property", "--runtime", UNIT, "MemoryMax=infinity", "MemorySwapMax=infinity")
    after = {s["slot"]: s for s in got["status"]["slots"]}
    killed = [slot for slot in after if after[slot]["pid"] != before[slot]["pid"]]
    assert len(killed) == 1, (before, after)
    slot = killed[0]
    assert after[slot]["generation"] == before[slot]["generation"] + 1 and after[slot]["state"] == "ready"
    assert got["unit"]["MainPID"] == str(main) and got["unit"]["NRestarts"] == n0, got["unit"]
    j = L.journal(since=t0)
    assert L.pid1_lines(j, "killed by the OOM killer"), L.messages(j)[-20:]
    crash = [d for _, d in named(j, "worker_crash") if d.get("pid") == before[slot]["pid"]]
    assert crash and "SIGKILL" in crash[0]["exit"], crash
    assert not named(j, "slot_failed"), named(j, "slot_failed")     # one kill is not a crash loop
    assert L.http_get("/")[0] == 200
    L.record("oom", {"killed_slot": slot, "crash_event": crash[0], "slot_after": after[slot]})


def test_watchdog_catches_a_stopped_supervisor() -> None:
    main = main_pid()
    workers = [s["pid"] for s in L.status()["slots"]]
    n0 = int(L.show("NRestarts")["NRestarts"])
    t0 = L.mono()
    os.kill(main, signal.SIGSTOP)
    try:
        hit = L.wait_for("Watchdog timeout", lambda: L.pid1_lines(L.journal(since=t0), "Watchdog timeout"),
                         timeout=120, step=2.0)
    except BaseException:
        os.kill(main, signal.SIGCONT)
        raise
    got = wait_serving({0, 1})
    t1 = L.mono()
    assert int(got["unit"]["NRestarts"]) == n0 + 1 and got["unit"]["MainPID"] != str(main), got["unit"]
    assert not L.alive(main)
    # the stopped supervisor's workers did not outlive it
    assert not any(L.alive(p) for p in workers), [p for p in workers if L.alive(p)]
    assert not set(workers) & L.unit_pids()
    j = L.journal(since=t0)
    failed = L.pid1_lines(j, "Failed with result 'watchdog'")
    restart = L.pid1_lines(j, "Scheduled restart job")
    assert failed and restart and hit[0][0] <= failed[0][0] <= restart[0][0], (hit, failed, restart)
    new_start = int(L.show("ExecMainStartTimestampMonotonic")["ExecMainStartTimestampMonotonic"]) / 1e6
    assert failed[0][0] < new_start       # systemd restarts only once the old cgroup is empty
    assert L.http_get("/")[0] == 200 and L.http_get("/readyz", port=L.ADMIN_PORT)[0] == 200
    L.record("watchdog", {"sigstop_to_timeout_s": round(hit[0][0] - t0, 2),
                          "sigstop_to_serving_again_s": round(t1 - t0, 2)})


# -------------------------------------------------------------------------- stop


def test_stop_under_load_finishes_in_flight_requests() -> None:
    main = main_pid()
    workers = [s["pid"] for s in L.status()["slots"]]
    load = L.Load(threads=3).start()
    L.wait_for("load flowing", lambda: len(load.ok()) >= 20, timeout=120)
    slow, threads = L.fire(["/slow?s=5"] * 4)
    time.sleep(1.5)                                  # accepted and in flight
    L.systemctl("log-level", "debug")
    try:
        t0 = L.mono()
        L.systemctl("stop", UNIT)
        t1 = L.mono()
    finally:
        L.systemctl("log-level", "info")
    load.stop()
    for t in threads:
        t.join(120)
    p = L.show("ActiveState", "SubState", "Result", "TimeoutStopUSec")
    assert (p["ActiveState"], p["SubState"], p["Result"]) == ("inactive", "dead", "success"), p
    assert [o.status for o in slow] == [200] * 4, slow          # in flight at the stop: finished
    assert all(o.status == 200 for o in load.outcomes if o.status is not None), \
        [o for o in load.outcomes if o.status not in (None, 200)]
    assert not [o for o in load.failed() if o.t1 < t0], "failures before the stop"
    j = L.journal(since=t0 - 0.5)
    assert [f for _, f in notifications(j, main) if f.startswith("STOPPING=1")], notifications(j, main)
    assert not L.pid1_lines(j, "timed out"), L.pid1_lines(j, "timed out")   # within TimeoutStopSec
    stopping = [e for e in j if e.get("EVENT") == "stopping"]
    assert stopping and stopping[0]["REASON"] == "SIGTERM", stopping
    assert not any(L.alive(x) for x in [main, *workers]) and not L.unit_pids()
    # the IRQs are back as they were (ExecStopPost=+ ... irq restore)
    assert {i: affinity(i) for i in STATE["irq_before"]} == STATE["irq_before"]
    assert not IRQ_STATE.exists()
    L.record("stop_under_load", {"systemctl_stop_s": round(t1 - t0, 2), "TimeoutStopUSec": p["TimeoutStopUSec"],
                                 "errors_after_stop": sorted({(o.error or "").split(":")[0] for o in load.failed()})})


# ---------------------------------------------------------------- cgroup cpuset


def test_allowed_cpus_dropin_shrinks_the_plan() -> None:
    from numaserve.cpulist import format_list, parse_list

    n1 = node_cpus()[1]
    (L.DROPINS / "40-cpuset.conf").write_text(
        f"[Service]\nAllowedCPUs={format_list(sorted(n1))}\nAllowedMemoryNodes=1\n")
    L.systemctl("daemon-reload")
    try:
        L.systemctl("start", UNIT)
        p = L.show("ActiveState", "SubState", "StatusText", "AllowedCPUs", "AllowedMemoryNodes")
        assert (p["ActiveState"], p["SubState"]) == ("active", "running") and p["StatusText"] == \
            "running: node1 1/1 ready", p
        # the cgroup v2 cpuset exactly as systemd wrote it
        assert set(parse_list((CGROUP / "cpuset.cpus").read_text())) == n1
        assert (CGROUP / "cpuset.mems").read_text().strip() == "1"
        assert set(parse_list((CGROUP / "cpuset.cpus.effective").read_text())) == n1
        st = L.status()
        assert [(s["node"], s["state"]) for s in st["slots"]] == [(1, "ready")], st["slots"]
        assert [s["node"] for s in st["plan"]["skipped"]] == [0], st["plan"]
        for pid in (st["supervisor"]["pid"], st["slots"][0]["pid"]):
            ps = L.proc_status(pid)
            assert set(parse_list(ps["Cpus_allowed_list"])) <= n1 and ps["Mems_allowed_list"] == "1", (pid, ps)
        assert L.http_get("/")[0] == 200
        L.record("cpuset", {"skipped": st["plan"]["skipped"]})
    finally:
        L.systemctl("stop", UNIT, check=False)
        (L.DROPINS / "40-cpuset.conf").unlink()
        L.systemctl("daemon-reload")
