"""`[irq] apply_at_start`: the supervisor steers NIC IRQs at start and restores them at exit.

Runs against a copy of a fixture sysfs/procfs tree (a 2-node VM's virtio NIC
on node 1), with a declared topology mapping this machine's two CPUs onto the
two nodes, so workers really run while IRQ files are written in the copy.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from tests.integration.harness import FAST_CONFIG, Running, two_pretend_nodes

pytestmark = pytest.mark.slow
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "irq" / "vm2n"


def _affinity(root: Path, irq: int) -> str:
    return (root / "proc" / "irq" / str(irq) / "smp_affinity_list").read_text().strip()


def test_irqs_applied_at_start_and_restored_at_exit(tmp_path: Path) -> None:
    # the fixture's online CPUs are 0-3; ours map onto them by number
    declared, cpus = two_pretend_nodes(tmp_path, "[nic.eth0]\nnode = 1\n")
    root = tmp_path / "root"
    shutil.copytree(FIXTURE, root, symlinks=True)
    before = {irq: _affinity(root, irq) for irq in range(31, 40)}
    state = tmp_path / "irq-saved.json"
    cfg = FAST_CONFIG + f'\n[irq]\napply_at_start = true\nirqbalance = "warn"\nstate_file = "{state}"\n'
    sup = Running(["--root", str(root), "--declared", str(declared), "--bind", "127.0.0.1:0"], config=cfg)
    try:
        st = sup.status()
        irq = st["supervisor"]["irq"]
        assert irq["applied"] is True and not irq["failed"], irq
        for q in range(32, 40):                      # every queue vector on node 1's CPU
            assert _affinity(root, q) == str(cpus[1]), (q, _affinity(root, q))
        assert _affinity(root, 31) == before[31]     # the config vector is left alone
        assert state.exists()
        sup.signal(signal.SIGTERM)
        assert sup.wait_exit(30) == 0
        assert {i: _affinity(root, i) for i in range(31, 40)} == before
        assert not state.exists()
    finally:
        sup.close()
