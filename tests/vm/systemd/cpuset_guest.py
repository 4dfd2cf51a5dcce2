"""Guest side of tests/vm/test_cpuset_vm.py: runs INSIDE the lab VM with a
systemd PID 1 (``run-in-numa-vm.sh --init systemd``), as root.

What a Kubernetes node with the static CPU manager does to a Guaranteed pod
is give its container a cgroup cpuset.  systemd makes the same thing with
``AllowedCPUs=`` (cpuset.cpus of a transient unit).  Inside such cpusets this
plans numaserve (``numaserve plan``), starts it for real (``systemd-run``, a
Type=notify unit, as the DaemonSet's container would run it), reads back where
every worker runs and how its memory is bound, and starts it once more with
set_mempolicy/mbind refused by a seccomp filter (a container without
CAP_SYS_NICE under the RuntimeDefault profile) to see how that fails.

Prints one JSON object per scenario on stdout (``CASE {...}``); the host test
asserts on them.  Never raises: a scenario that breaks reports its error.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable
from tests.vm.guestkit import ops_status

REPO = Path(__file__).resolve().parents[3]
PY = sys.executable


def emit(name: str, fn: Callable[[], dict[str, Any]]) -> None:
    t0 = time.monotonic()
    try:
        out = fn()
    except Exception:
        out = {"error": traceback.format_exc()[-3000:]}
    out["seconds"] = round(time.monotonic() - t0, 1)
    print("CASE " + json.dumps({"name": name, **out}), flush=True)


def sh(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)


def in_cpuset(cpus: str, *argv: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run argv in a transient unit whose cgroup cpuset is ``cpus`` (systemd-run --wait --pipe)."""
    return sh("systemd-run", "--wait", "--pipe", "--quiet", "--collect", "-p", f"AllowedCPUs={cpus}",
              "-E", f"PYTHONPATH={REPO}", "--working-directory", str(REPO), *extra, "--", *argv)


def plan(cpus: str) -> dict[str, Any]:
    r = in_cpuset(cpus, PY, "-m", "numaserve", "plan", "--nodes", "all", "--workers-per-node", "auto", "--json")
    if r.returncode != 0:
        return {"rc": r.returncode, "stderr": r.stderr[-2000:]}
    p = json.loads(r.stdout)
    return {"rc": 0, "slots": [{"node": s["node"], "cpus": s["cpus"], "mempolicy": s["mempolicy"],
                                "memory_nodes": s["memory_nodes"]} for s in p["slots"]],
            "skipped": p.get("skipped", [])}


def _cpus_allowed(pid: int) -> list[str]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out.append(line.split(":", 1)[1].strip())
    return sorted(set(out))


def _mempolicy(pid: int) -> list[str]:
    """Distinct policies of the worker's mappings in numa_maps (bind:1, default ...)."""
    pols = set()
    for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
        parts = line.split()
        if len(parts) > 1:
            pols.add(parts[1])
    return sorted(pols)


def start(cpus: str, unit: str, *, extra: tuple[str, ...] = (), wait_ready: bool = True) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix="ns-cpuset-"))
    rt = str(d / "rt")
    cfg = d / "numaserve.toml"
    # slow TCG guest: generous timeouts
    cfg.write_text('[server]\nbind = ["127.0.0.1:18000"]\nlb_grace = 5.0\n'
                   '[placement]\nnodes = "all"\nworkers_per_node = "auto"\n'
                   '[supervisor]\nready_timeout = 240.0\nheartbeat_interval = 1.0\nheartbeat_timeout = 60.0\n'
                   '[admin]\nbind = "127.0.0.1:19180"\n[log]\nformat = "json"\n')
    r = sh("systemd-run", "--unit", unit, "-p", "Type=notify", "-p", "NotifyAccess=main",
           "-p", f"AllowedCPUs={cpus}", "-p", "TimeoutStartSec=300", "-p", "KillMode=mixed",
           "-E", f"PYTHONPATH={REPO}", "--working-directory", str(REPO), *extra, "--",
           PY, "-m", "numaserve", "start", "--config", str(cfg), "--runtime-dir", rt, timeout=330)
    out: dict[str, Any] = {"start_rc": r.returncode, "start_stderr": r.stderr[-1500:]}
    try:
        props = sh("systemctl", "show", unit, "-p", "ActiveState,SubState,Result,ExecMainStatus,StatusText").stdout
        out["unit"] = dict(ln.split("=", 1) for ln in props.splitlines() if "=" in ln)
        if wait_ready and r.returncode == 0:
            st = ops_status(rt)
            out["supervisor_cpus"] = _cpus_allowed(int(st["supervisor"]["pid"])) if st else None
            out["slots"] = []
            for s in (st or {}).get("slots", []):
                pid = s.get("pid")
                out["slots"].append({
                    "slot": s["slot"], "node": s["node"], "state": s["state"],
                    "planned_cpus": s.get("cpus"), "binding_verified": s.get("binding_verified"),
                    "threads_cpus_allowed": _cpus_allowed(pid) if pid else None,
                    "numa_maps_policies": _mempolicy(pid) if pid else None,
                })
            c = http.client.HTTPConnection("127.0.0.1", 18000, timeout=60)
            c.request("GET", "/", headers={"Connection": "close"})
            resp = c.getresponse()
            out["http"] = [resp.status, json.loads(resp.read())]
            c.close()
    finally:
        sh("systemctl", "stop", unit, timeout=120)
        props = sh("systemctl", "show", unit, "-p", "ActiveState,Result,ExecMainStatus").stdout
        out["after_stop"] = dict(ln.split("=", 1) for ln in props.splitlines() if "=" in ln)
        out["journal"] = sh("journalctl", "-u", unit, "-o", "cat", "--no-pager").stdout[-6000:]
        sh("systemctl", "reset-failed", unit)
    return out


def main() -> int:
    print("CPUS " + json.dumps({n.name: (n / "cpulist").read_text().strip()
                                for n in sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))}), flush=True)
    # a pod whose exclusive CPUs are all on node 1 (topologyManagerPolicy single-numa-node)
    emit("plan_single_node", lambda: plan("2-3"))
    # a pod bigger than one node, spread over both (restricted / best-effort)
    emit("plan_two_nodes", lambda: plan("1-3"))
    emit("start_single_node", lambda: start("2-3", "ns-cpuset-one"))
    # set_mempolicy/mbind refused like RuntimeDefault seccomp without CAP_SYS_NICE
    emit("start_without_mempolicy_syscalls", lambda: start(
        "2-3", "ns-cpuset-seccomp", wait_ready=False,
        extra=("-p", "SystemCallFilter=~set_mempolicy mbind", "-p", "SystemCallErrorNumber=EPERM")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
