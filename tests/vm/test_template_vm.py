"""Host side: boot the 2-node NUMA lab VM once for the warm-template guest tests
(``tests/vm/template_guest``): a preload hook allocates 200 MB in the node-1
template; every node-1 worker forked from it is checked from outside (threads
pinned to its slot, bind=static:1, the 200 MB shared and on N1).

Skipped like tests/vm/test_in_vm.py (no lab, not root, not x86_64, already in
the VM).  Run it under the heavy-work lock.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import vmlab
from vmlab import VmRun

GUEST_DIR = Path(__file__).resolve().parent / "template_guest"
VM_TIMEOUT = int(os.environ.get("NUMASERVE_VM_TIMEOUT", "900"))
GUEST_TESTS = vmlab.guest_tests(GUEST_DIR)


@pytest.fixture(scope="module")
def vm_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> VmRun:
    share = tmp_path_factory.mktemp("vm-template")
    return vmlab.run_guest_pytest(
        GUEST_DIR, vmlab.selected(request, __name__, GUEST_TESTS), GUEST_TESTS, share,
        timeout=VM_TIMEOUT, test_timeout=600, lab_args=["--mem-per-node", "1024"],
        pytest_args=vmlab.extra_pytest_args(),
    )


def test_guest_tests_found() -> None:
    assert GUEST_TESTS == ["test_template_guest.py::test_node1_workers_forked_from_a_node1_template_share_its_200mb_on_n1"]


@pytest.mark.parametrize("guest_test", GUEST_TESTS)
@pytest.mark.vm
@pytest.mark.slow
@pytest.mark.timeout(VM_TIMEOUT + 300)
@vmlab.skip_all
def test_guest(vm_run: VmRun, guest_test: str) -> None:
    vmlab.report(vm_run, guest_test)
