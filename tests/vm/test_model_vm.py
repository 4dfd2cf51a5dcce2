"""Host side: boot the 2-node NUMA lab VM once for the reference model guest test
(``tests/vm/model_guest``): each node's template holds its own copy of the weights
on its node (numa_maps) and its forked workers share it.

Skipped like tests/vm/test_in_vm.py (no lab, not root, not x86_64, already in
the VM).  Run it under the heavy-work lock.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import vmlab
from vmlab import VmRun

GUEST_DIR = Path(__file__).resolve().parent / "model_guest"
VM_TIMEOUT = int(os.environ.get("NUMASERVE_VM_TIMEOUT", "1200"))
GUEST_TESTS = vmlab.guest_tests(GUEST_DIR)


@pytest.fixture(scope="module")
def vm_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> VmRun:
    share = tmp_path_factory.mktemp("vm-model")
    return vmlab.run_guest_pytest(
        GUEST_DIR, vmlab.selected(request, __name__, GUEST_TESTS), GUEST_TESTS, share,
        timeout=VM_TIMEOUT, test_timeout=900, lab_args=["--mem-per-node", "1024"],
        pytest_args=vmlab.extra_pytest_args(),
    )


def test_guest_tests_found() -> None:
    assert GUEST_TESTS == ["test_model_guest.py::"
                           "test_each_template_holds_its_weights_on_its_node_and_its_workers_share_them"]


@pytest.mark.parametrize("guest_test", GUEST_TESTS)
@pytest.mark.vm
@pytest.mark.slow
@pytest.mark.timeout(VM_TIMEOUT + 300)
@vmlab.skip_all
def test_guest(vm_run: VmRun, guest_test: str) -> None:
    vmlab.report(vm_run, guest_test)
