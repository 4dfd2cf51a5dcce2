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

import ast
import os
import platform
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GUEST_DIR = Path(__file__).resolve().parent / "guest"
LAB_SCRIPT = REPO.parent / "shared" / "lab" / "numa-vm" / "run-in-numa-vm.sh"
VM_TIMEOUT = int(os.environ.get("NUMASERVE_VM_TIMEOUT", "900"))



def guest_tests(guest_dir: Path = GUEST_DIR) -> list[str]:
    """Node ids relative to the guest dir ("file.py::test_x", "file.py::TestC::test_y"), by AST.

    Static on purpose: collecting with pytest would import guest modules on the host.
    """
    out: list[str] = []
    for path in sorted(guest_dir.glob("test_*.py")):
        try:
            tree = ast.parse(path.read_text(), str(path))
        except SyntaxError:
            out.append(f"{path.name}::<module>")  # reported as the collection error it is
            continue
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
                out.append(f"{path.name}::{node.name}")
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name.startswith("test"):
                        out.append(f"{path.name}::{node.name}::{sub.name}")
    return out


GUEST_TESTS = guest_tests()


@dataclass
class CaseResult:
    outcome: str  # passed | failed | skipped
    text: str = ""


@dataclass
class VmRun:
    rc: int | None
    seconds: float
    stdout: str
    stderr: str
    xml_path: Path
    results: dict[str, list[CaseResult]] = field(default_factory=dict)
    module_errors: dict[str, str] = field(default_factory=dict)
    xml_error: str | None = None

    def tail(self, n: int = 40) -> str:
        lines = (self.stdout + "\n" + self.stderr).strip().splitlines()
        return "\n".join(lines[-n:])


def parse_junit(xml_text: str, known_files: set[str]) -> tuple[dict[str, list[CaseResult]], dict[str, str]]:
    """JUnit XML → {"file.py::[Class::]func": [case results]} and {file.py: collection error}.

    pytest's classname is the dotted module path (plus the class), the name
    carries parametrize ids; both are mapped back onto our static node ids.
    """
    results: dict[str, list[CaseResult]] = {}
    module_errors: dict[str, str] = {}
    stems = {Path(f).stem: f for f in known_files}
    root = ET.fromstring(xml_text)
    for case in root.iter("testcase"):
        classname = case.get("classname", "")
        name = case.get("name", "")
        parts = [p for p in classname.split(".") if p]
        fname, cls = None, None
        for i, p in enumerate(parts):
            if p in stems:
                fname = stems[p]
                cls = parts[i + 1] if i + 1 < len(parts) else None
        outcome, text = "passed", ""
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                outcome = "failed"
                text = ((el.get("message") or "") + "\n" + (el.text or "")).strip()
        sk = case.find("skipped")
        if outcome == "passed" and sk is not None:
            outcome, text = "skipped", sk.get("message") or (sk.text or "").strip()
        if fname is None:
            # collection error: classname "" and name "tests.vm.guest.test_x"
            stem = name.rsplit(".", 1)[-1]
            if stem in stems and outcome == "failed":
                module_errors[stems[stem]] = text
            continue
        func = name.split("[", 1)[0]
        key = f"{fname}::{cls}::{func}" if cls else f"{fname}::{func}"
        results.setdefault(key, []).append(CaseResult(outcome, text))
    return results, module_errors


def _selected(request: pytest.FixtureRequest) -> list[str]:
    mine = [
        it.callspec.params["guest_test"]
        for it in request.session.items
        if getattr(it, "module", None) is sys.modules[__name__]
        and "guest_test" in getattr(getattr(it, "callspec", None), "params", {})
    ]
    return mine or list(GUEST_TESTS)


@pytest.fixture(scope="module")
def vm_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> VmRun:
    """One VM boot running the selected guest tests; never raises (tests report)."""
    share = tmp_path_factory.mktemp("vm-results")
    xml_path = share / "guest.xml"
    selected = _selected(request)
    rel = GUEST_DIR.relative_to(REPO)
    if sorted(selected) == sorted(GUEST_TESTS):
        targets = [str(rel)]  # whole dir: collection errors of any file are reported too
    else:
        targets = [f"{rel}/{t}" for t in selected if not t.endswith("::<module>")]
    cmd = [
        str(LAB_SCRIPT), "--cwd", str(REPO), "--timeout", str(VM_TIMEOUT), "--share", str(share),
        "--env", "NUMASERVE_IN_VM=1", "--env", "PYTHONUNBUFFERED=1", "--",
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rA", "--timeout", "600",
        "-o", "junit_family=xunit2", f"--junitxml={xml_path}",
        *shlex.split(os.environ.get("NUMASERVE_VM_PYTEST_ARGS", "")), *targets,
    ]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=VM_TIMEOUT + 120, cwd=REPO)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = None, str(e.stdout or ""), str(e.stderr or "") + "\nhost: VM script timed out"
    seconds = time.monotonic() - t0
    (share / "vm-stdout.txt").write_text(out)
    (share / "vm-stderr.txt").write_text(err)
    run = VmRun(rc, seconds, out, err, xml_path)
    try:
        run.results, run.module_errors = parse_junit(xml_path.read_text(), {t.split("::")[0] for t in GUEST_TESTS})
    except (OSError, ET.ParseError) as e:
        run.xml_error = f"{type(e).__name__}: {e}"
    print(f"\n[vm] {len(selected)} guest test(s), VM exit {rc}, {seconds:.1f} s; output in {share}")
    return run


@pytest.mark.parametrize("guest_test", GUEST_TESTS)
@pytest.mark.vm
@pytest.mark.slow
@pytest.mark.timeout(VM_TIMEOUT + 300)
@pytest.mark.skipif(os.environ.get("NUMASERVE_IN_VM") == "1", reason="already inside the VM")
@pytest.mark.skipif(not LAB_SCRIPT.exists(), reason=f"NUMA lab not found at {LAB_SCRIPT}")
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the NUMA lab VM is x86_64 only")
@pytest.mark.skipif(os.geteuid() != 0, reason="the NUMA lab VM needs root")
def test_guest(vm_run: VmRun, guest_test: str) -> None:
    where = f"VM exit {vm_run.rc} after {vm_run.seconds:.0f} s"
    fname = guest_test.split("::")[0]
    if fname in vm_run.module_errors:
        pytest.fail(f"{fname} failed to collect in the VM ({where}):\n{vm_run.module_errors[fname]}", pytrace=False)
    if vm_run.xml_error is not None:
        pytest.fail(f"no guest results ({vm_run.xml_error}; {where}); VM output tail:\n{vm_run.tail()}", pytrace=False)
    cases = vm_run.results.get(guest_test)
    if not cases:
        pytest.fail(f"{guest_test} did not run in the VM ({where}); VM output tail:\n{vm_run.tail()}", pytrace=False)
    failed = [c for c in cases if c.outcome == "failed"]
    if failed:
        pytest.fail(f"{guest_test} failed in the VM:\n" + "\n---\n".join(c.text for c in failed), pytrace=False)
    if all(c.outcome == "skipped" for c in cases):
        pytest.skip(f"skipped in the VM: {cases[0].text}")


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
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", str(GUEST_DIR)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "NUMASERVE_IN_VM"},
    )
    assert "test_binding_guest" not in r.stdout, r.stdout
