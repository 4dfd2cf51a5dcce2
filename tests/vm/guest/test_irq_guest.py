"""IRQ steering on a real multi-node kernel (runs INSIDE the NUMA lab VM).

The VM (../shared/lab/numa-vm) has 2 nodes (CPUs 0-1, 2-3) and a 4-queue
virtio-net NIC behind a pxb-pcie on node 1: IRQs ``virtioN-config`` and
``virtioN-input.Q`` / ``virtioN-output.Q``.  ``irq plan`` must put every
queue IRQ on CPUs 2-3 and leave the config vector alone; ``apply`` writes
``/proc/irq/N/smp_affinity_list``; ``restore`` puts back the exact old values.

The ``irq`` click group is invoked directly (CliRunner): it is not registered
in ``numaserve.cli.COMMANDS`` until the lead wires it.  Skips unless
NUMASERVE_IN_VM=1 and the machine has >= 2 NUMA nodes (never touches a real
host's IRQs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from numaserve.cpulist import parse_list

NODE_ONLINE = Path("/sys/devices/system/node/online")


def _nodes() -> tuple[int, ...]:
    try:
        return parse_list(NODE_ONLINE.read_text())
    except OSError:
        return ()


pytestmark = [
    pytest.mark.skipif(os.environ.get("NUMASERVE_IN_VM") != "1", reason="runs only inside the NUMA VM"),
    pytest.mark.skipif(len(_nodes()) < 2, reason="needs >= 2 NUMA nodes"),
]


def _irq_cli(args: list[str], cfg: Path) -> dict:
    from numaserve.cli.irq_cmd import irq

    r = CliRunner().invoke(irq, args + ["--config", str(cfg), "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _aff(irq: int) -> str:
    return Path(f"/proc/irq/{irq}/smp_affinity_list").read_text().strip()


def test_plan_apply_restore_on_node1_nic(tmp_path: Path) -> None:
    from numaserve.topology import discover

    topo = discover("/")
    if topo.system.irqbalance_running:
        pytest.skip("irqbalance runs in this guest")
    nics = [n for n in topo.nics if n.numa_node is not None and any(i.kind == "queue" for i in n.irqs)]
    if not nics:
        pytest.skip(f"no NIC with a known node and queue IRQs: {[(n.name, n.numa_node) for n in topo.nics]}")
    nic = nics[0]
    node_cpus = set(topo.node(nic.numa_node).cpus)
    assert nic.numa_node == 1 and node_cpus == {2, 3}, (nic, node_cpus)
    queue_irqs = {i.irq for i in nic.irqs if i.kind == "queue"}
    admin = {i.irq: i.name for i in nic.irqs if i.kind == "admin"}
    assert len(queue_irqs) == 8 and any((name or "").endswith("-config") for name in admin.values()), nic.irqs

    cfg = tmp_path / "numaserve.toml"
    cfg.write_text("")
    state = tmp_path / "irq-saved.json"
    all_irqs = sorted(queue_irqs | set(admin))
    before = {i: _aff(i) for i in all_irqs}

    plan = _irq_cli(["plan", "--iface", nic.name], cfg)
    targets = {e["irq"]: parse_list(e["target"]) for e in plan["entries"]}
    assert set(targets) == queue_irqs
    assert all(len(t) == 1 and set(t) <= node_cpus for t in targets.values()), targets
    assert {c for t in targets.values() for c in t} == node_cpus  # both node-1 CPUs used
    assert set(admin) <= {s["irq"] for s in plan["skipped"]}
    assert all(before[i] == _aff(i) for i in all_irqs)  # plan wrote nothing

    res = _irq_cli(["apply", "--iface", nic.name, "--state-file", str(state)], cfg)
    assert res["failed"] == 0, res
    for irq, t in targets.items():
        assert parse_list(_aff(irq)) == t, (irq, _aff(irq), t)
    for irq in admin:
        assert _aff(irq) == before[irq]  # config vector untouched
    assert state.exists()

    again = _irq_cli(["apply", "--iface", nic.name, "--state-file", str(state)], cfg)
    assert {r["status"] for r in again["irqs"]} == {"unchanged"}

    res = _irq_cli(["restore", "--state-file", str(state)], cfg)
    assert res["failed"] == 0 and res["state_removed"], res
    assert {i: _aff(i) for i in all_irqs} == before
    assert not state.exists()
