"""numaserve inside a cgroup cpuset, as Kubernetes' static CPU manager makes one.

Boots the 2-node NUMA lab VM ONCE with a real systemd PID 1
(``run-in-numa-vm.sh --init systemd``; node 0 = CPUs 0-1, node 1 = CPUs 2-3)
and runs ``tests/vm/systemd/cpuset_guest.py`` there: ``numaserve plan`` and a
real ``numaserve start`` inside ``systemd-run -p AllowedCPUs=...`` units, and
a start with set_mempolicy/mbind refused by a seccomp filter.  The tests here
assert on what the guest reports.  Skipped like tests/vm/test_in_vm.py (no
lab, not root, not x86_64, already in the VM).  ~3 min under TCG; run it
under the heavy-work lock.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from vmlab import LAB_SCRIPT, REPO, run_lab

GUEST = Path(__file__).resolve().parent / "systemd" / "cpuset_guest.py"
VM_TIMEOUT = int(os.environ.get("NUMASERVE_VM_TIMEOUT", "900"))

pytestmark = [
    pytest.mark.vm,
    pytest.mark.slow,
    pytest.mark.timeout(VM_TIMEOUT + 300),
    pytest.mark.skipif(os.environ.get("NUMASERVE_IN_VM") == "1", reason="already inside the VM"),
    pytest.mark.skipif(not LAB_SCRIPT.exists(), reason=f"NUMA lab not found at {LAB_SCRIPT}"),
    pytest.mark.skipif(platform.machine() != "x86_64", reason="the NUMA lab VM is x86_64 only"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the NUMA lab VM needs root"),
]


@pytest.fixture(scope="module")
def guest(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cmd = [str(LAB_SCRIPT), "--init", "systemd", "--cwd", str(REPO), "--timeout", str(VM_TIMEOUT),
           "--env", "NUMASERVE_IN_VM=1", "--env", "PYTHONUNBUFFERED=1", "--env", f"PYTHONPATH={REPO}",
           "--", sys.executable, str(GUEST)]
    t0 = time.monotonic()
    rc, stdout, stderr = run_lab(cmd, VM_TIMEOUT + 120)
    cases: dict[str, Any] = {"_vm": {"rc": rc, "seconds": round(time.monotonic() - t0, 1),
                                     "tail": (stdout + "\n" + stderr)[-3000:]}}
    for line in stdout.splitlines():
        if line.startswith("CASE "):
            c = json.loads(line[5:])
            cases[c["name"]] = c
        elif line.startswith("CPUS "):
            cases["_cpus"] = json.loads(line[5:])
    out = tmp_path_factory.mktemp("vm-cpuset") / "cases.json"
    out.write_text(json.dumps(cases, indent=2))
    print(f"\n[vm] cpuset guest: exit {rc} after {cases['_vm']['seconds']} s; cases in {out}")
    return cases


def case(guest: dict[str, Any], name: str) -> dict[str, Any]:
    c = guest.get(name)
    if c is None:
        pytest.fail(f"{name} did not run in the VM (VM exit {guest['_vm']['rc']}):\n{guest['_vm']['tail']}",
                    pytrace=False)
    if "error" in c:
        pytest.fail(f"{name} broke in the VM:\n{c['error']}", pytrace=False)
    return c


def test_lab_topology(guest: dict[str, Any]) -> None:
    assert guest.get("_cpus") == {"node0": "0-1", "node1": "2-3"}, guest["_vm"]


def test_plan_inside_a_single_node_cpuset(guest: dict[str, Any]) -> None:
    """single-numa-node: every exclusive CPU on node 1 -> node 1 only, one worker per core, memory on node 1."""
    c = case(guest, "plan_single_node")
    assert c["rc"] == 0, c
    assert c["slots"] == [{"node": 1, "cpus": [2], "mempolicy": "bind", "memory_nodes": [1]},
                          {"node": 1, "cpus": [3], "mempolicy": "bind", "memory_nodes": [1]}], c
    assert [s["node"] for s in c["skipped"]] == [0] and "no usable CPUs" in c["skipped"][0]["reason"], c


def test_plan_inside_a_cpuset_spanning_two_nodes(guest: dict[str, Any]) -> None:
    """A pod bigger than one node: each node's share gets its own workers and local memory."""
    c = case(guest, "plan_two_nodes")
    assert c["rc"] == 0, c
    assert [(s["node"], s["cpus"], s["memory_nodes"]) for s in c["slots"]] == [
        (0, [1], [0]), (1, [2], [1]), (1, [3], [1])], c
    assert c["skipped"] == []


def test_start_inside_a_cpuset_binds_every_worker_there(guest: dict[str, Any]) -> None:
    c = case(guest, "start_single_node")
    assert c["start_rc"] == 0, c                      # Type=notify: READY=1 came
    assert c["supervisor_cpus"] == ["2-3"], c         # the unit's cpuset
    slots = c["slots"]
    assert [(s["node"], s["planned_cpus"], s["state"]) for s in slots] == [(1, [2], "ready"), (1, [3], "ready")], c
    for s in slots:
        assert s["binding_verified"] is True, s
        assert s["threads_cpus_allowed"] == [str(s["planned_cpus"][0])], s   # every thread
        assert s["numa_maps_policies"] == ["bind=static:1"], s         # every mapping, from birth
    assert c["http"][0] == 200 and c["http"][1]["node"] == 1, c["http"]
    assert c["after_stop"]["Result"] == "success" and c["after_stop"]["ExecMainStatus"] == "0", c["after_stop"]
    # nothing probed /readyz: the stop did not wait for a balancer
    grace = [json.loads(ln) for ln in c["journal"].splitlines() if '"lb_grace"' in ln]
    assert grace and grace[0]["seconds"] == 0, c["journal"]


def test_start_without_the_mempolicy_syscalls_fails_with_the_reason(guest: dict[str, Any]) -> None:
    """What a container without CAP_SYS_NICE under RuntimeDefault seccomp gets:
    no slot can bind its memory, the start fails (exit 3) and says why."""
    c = case(guest, "start_without_mempolicy_syscalls")
    assert c["start_rc"] != 0, c
    assert c["after_stop"]["ExecMainStatus"] == "3", c
    assert "set_mempolicy" in c["journal"] and "Operation not permitted" in c["journal"], c["journal"]
