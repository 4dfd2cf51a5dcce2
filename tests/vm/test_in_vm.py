"""Host side of the VM tests: boot the 2-node NUMA lab VM ONCE, run every guest test.

The VM (``../shared/lab/numa-vm/run-in-numa-vm.sh``, TCG: ~7 s boot, 2–4 s per
Python start, ~15 s pytest import) runs ``pytest tests/vm/guest`` with
``NUMASERVE_IN_VM=1`` and writes JUnit XML to a ``--share``d directory.  Each
guest test function (found statically in ``tests/vm/guest/test_*.py``, so new
guest files are picked up without touching this file) becomes one host test
that passes, fails with the guest's failure text, or skips with its reason.

Skipped when the lab is absent, not root, not x86_64, or when already inside
the VM.  ``NUMASERVE_VM_PYTEST_ARGS`` adds guest pytest arguments (e.g. ``-x``);
``NUMASERVE_VM_TIMEOUT`` overrides the VM timeout (default 900 s).  Selecting a
subset on the host (``-k``) runs only that subset in the guest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import vmlab
from vmlab import LAB_SCRIPT, REPO, CaseResult, VmRun, parse_junit  # noqa: F401  (re-exported)

GUEST_DIR = Path(__file__).resolve().parent / "guest"
VM_TIMEOUT = int(os.environ.get("NUMASERVE_VM_TIMEOUT", "900"))


def guest_tests(guest_dir: Path = GUEST_DIR) -> list[str]:
    return vmlab.guest_tests(guest_dir)


GUEST_TESTS = guest_tests()


@pytest.fixture(scope="module")
def vm_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> VmRun:
    """One VM boot running the selected guest tests; never raises (tests report)."""
    share = tmp_path_factory.mktemp("vm-results")
    return vmlab.run_guest_pytest(
        GUEST_DIR, vmlab.selected(request, __name__, GUEST_TESTS), GUEST_TESTS, share,
        timeout=VM_TIMEOUT, test_timeout=600, pytest_args=vmlab.extra_pytest_args(),
    )


@pytest.mark.parametrize("guest_test", GUEST_TESTS)
@pytest.mark.vm
@pytest.mark.slow
@pytest.mark.timeout(VM_TIMEOUT + 300)
@vmlab.skip_all
def test_guest(vm_run: VmRun, guest_test: str) -> None:
    vmlab.report(vm_run, guest_test)


# ------------------------------------------------- harness self-tests (host, fast)


def test_guest_tests_are_found_statically(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text(
        "import pytest\n"
        "def test_one(): pass\n"
        "@pytest.mark.parametrize('x', [1, 2])\n"
        "async def test_two(x): pass\n"
        "def helper(): pass\n"
        "class TestThing:\n"
        "    def test_m(self): pass\n"
        "    def other(self): pass\n"
    )
    (tmp_path / "test_b.py").write_text("def test_z(:\n")
    (tmp_path / "conftest.py").write_text("def test_not_a_test(): pass\n")
    assert guest_tests(tmp_path) == [
        "test_a.py::test_one", "test_a.py::test_two", "test_a.py::TestThing::test_m", "test_b.py::<module>",
    ]
    assert "test_binding_guest.py::test_exec_node1_binds_every_thread_and_200mb" in GUEST_TESTS


def test_junit_mapping() -> None:
    xml = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
    <testcase classname="tests.vm.guest.test_a" name="test_one" time="1"/>
    <testcase classname="tests.vm.guest.test_a" name="test_two[1]" time="1"/>
    <testcase classname="tests.vm.guest.test_a" name="test_two[2]" time="1">
      <failure message="AssertionError: boom">trace</failure></testcase>
    <testcase classname="tests.vm.guest.test_a.TestThing" name="test_m" time="1">
      <skipped type="pytest.skip" message="needs &gt;= 2 NUMA nodes">skip</skipped></testcase>
    <testcase classname="" name="tests.vm.guest.test_b" time="0">
      <error message="collection failure">SyntaxError</error></testcase>
    </testsuite></testsuites>"""
    results, errors = parse_junit(xml, {"test_a.py", "test_b.py"})
    assert [c.outcome for c in results["test_a.py::test_one"]] == ["passed"]
    assert [c.outcome for c in results["test_a.py::test_two"]] == ["passed", "failed"]
    assert "boom" in results["test_a.py::test_two"][1].text
    assert results["test_a.py::TestThing::test_m"][0].outcome == "skipped"
    assert "SyntaxError" in errors["test_b.py"]


def test_guest_files_are_not_collected_on_the_host() -> None:
    if os.environ.get("NUMASERVE_IN_VM") == "1":
        pytest.skip("inside the VM")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "--collect-only", "-q", str(GUEST_DIR)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "NUMASERVE_IN_VM"},
    )
    assert "test_binding_guest" not in r.stdout, r.stdout
