"""Host side: boot the 2-node NUMA lab VM once for the locality guest test
(``tests/vm/locality_guest``): a worker whose pages are pushed to the other
node (``migratepages``) is measured in status and /metrics, the alert's
expression is true on the scraped value, and ``[placement] repair =
"migrate"`` moves the pages back above 95 %.

Skipped like tests/vm/test_in_vm.py (no lab, not root, not x86_64, already in
the VM).  Run it under the VM lock (flock /tmp/numavm.lock).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import vmlab
from vmlab import VmRun

GUEST_DIR = Path(__file__).resolve().parent / "locality_guest"
VM_TIMEOUT = int(os.environ.get("NUMASERVE_VM_TIMEOUT", "900"))
GUEST_TESTS = vmlab.guest_tests(GUEST_DIR)


@pytest.fixture(scope="module")
def vm_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> VmRun:
    share = tmp_path_factory.mktemp("vm-locality")
    return vmlab.run_guest_pytest(
        GUEST_DIR, vmlab.selected(request, __name__, GUEST_TESTS), GUEST_TESTS, share,
        timeout=VM_TIMEOUT, test_timeout=800, lab_args=["--mem-per-node", "1024"],
        pytest_args=vmlab.extra_pytest_args(),
    )


def test_guest_tests_found() -> None:
    assert GUEST_TESTS == [
        "test_locality_guest.py::test_pages_pushed_to_the_other_node_are_measured_alerted_and_migrated_back"]


@pytest.mark.parametrize("guest_test", GUEST_TESTS)
@pytest.mark.vm
@pytest.mark.slow
@pytest.mark.timeout(VM_TIMEOUT + 300)
@vmlab.skip_all
def test_guest(vm_run: VmRun, guest_test: str) -> None:
    vmlab.report(vm_run, guest_test)
