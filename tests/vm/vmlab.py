"""Shared host-side machinery of the VM test modules (not a test file).

One VM boot (``../shared/lab/numa-vm/run-in-numa-vm.sh``) runs a guest pytest
over a directory of guest tests and writes JUnit XML into a ``--share``d
directory; each guest test function (found statically, so the host never
imports guest code) becomes one host test that passes, fails with the guest's
failure text, or skips with its reason.
"""

from __future__ import annotations

import ast
import fcntl
import os
import re
import platform
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pytest

REPO = Path(__file__).resolve().parents[2]
# NUMASERVE_NUMA_LAB: the lab script's path when the checkout is not beside ``shared/`` (a git worktree)
LAB_SCRIPT = Path(os.environ.get("NUMASERVE_NUMA_LAB") or REPO.parent / "shared" / "lab" / "numa-vm" / "run-in-numa-vm.sh")


#: The lab's kernel/initramfs cache (the script's NUMA_VM_CACHE default).
LAB_CACHE = Path(os.environ.get("NUMA_VM_CACHE") or "/tmp/numa-vm-cache")


def _cache_warm() -> bool:
    """The lab script has built its initramfs for its current version (it writes
    ``initramfs.cpio.gz.tmp`` and renames it, under one fixed name: two cold boots at once race
    on it, and the loser fails with ``mv: cannot stat ...tmp`` after 3 s)."""
    try:
        version = re.search(r"^SCRIPT_VERSION=(\S+)", LAB_SCRIPT.read_text(), re.M)
    except OSError:
        return False
    return bool(version) and any(LAB_CACHE.glob(f"*-v{version.group(1)}/initramfs.cpio.gz"))


def run_lab(cmd: Sequence[str], timeout: float) -> tuple[int | None, str, str]:
    """Run the lab script: (exit code or None on timeout, stdout, stderr).

    While the cache is cold, one boot at a time builds it: the others wait on a lock until the
    initramfs is there (or the builder exited), then boot as usual; the two VM chains of the
    suite start together (``tests/conftest.py``), on a fresh /tmp both would build it."""
    LAB_CACHE.mkdir(parents=True, exist_ok=True)
    with open(LAB_CACHE / ".numaserve-build.lock", "w") as lock, \
            open(os.devnull, "rb") as stdin, _Capture() as out, _Capture() as err:
        locked = not _cache_warm()
        if locked:
            fcntl.flock(lock, fcntl.LOCK_EX)
            locked = not _cache_warm()
            if not locked:
                fcntl.flock(lock, fcntl.LOCK_UN)
        p = subprocess.Popen(list(cmd), stdin=stdin, stdout=out.f, stderr=err.f, cwd=REPO)
        deadline = time.monotonic() + timeout
        try:
            while locked and p.poll() is None and time.monotonic() < deadline:
                if _cache_warm():
                    break
                time.sleep(0.5)
            if locked:
                fcntl.flock(lock, fcntl.LOCK_UN)
            rc: int | None = p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = None
        return rc, out.text(), err.text()


class _Capture:
    """A temporary file for a child's output (a pipe could fill while the parent polls)."""

    def __enter__(self) -> "_Capture":
        import tempfile
        self.f = tempfile.TemporaryFile()
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def text(self) -> str:
        self.f.seek(0)
        return self.f.read().decode(errors="replace")


def skip_marks() -> list[pytest.MarkDecorator]:
    """Where no VM can boot: already inside one, no lab, not x86_64, not root."""
    return [
        pytest.mark.skipif(os.environ.get("NUMASERVE_IN_VM") == "1", reason="already inside the VM"),
        pytest.mark.skipif(not LAB_SCRIPT.exists(), reason=f"NUMA lab not found at {LAB_SCRIPT}"),
        pytest.mark.skipif(platform.machine() != "x86_64", reason="the NUMA lab VM is x86_64 only"),
        pytest.mark.skipif(os.geteuid() != 0, reason="the NUMA lab VM needs root"),
    ]


def skip_all(fn: Any) -> Any:
    """Decorator: every skip of ``skip_marks``."""
    for mark in reversed(skip_marks()):
        fn = mark(fn)
    return fn


def guest_tests(guest_dir: Path) -> list[str]:
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
    share: Path | None = None
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


def selected(request: pytest.FixtureRequest, module_name: str, all_tests: list[str]) -> list[str]:
    """Guest tests the host session selected (``-k``) from one host module, else all."""
    mine = [
        it.callspec.params["guest_test"]
        for it in request.session.items
        if getattr(it, "module", None) is sys.modules[module_name]
        and "guest_test" in getattr(getattr(it, "callspec", None), "params", {})
    ]
    return mine or list(all_tests)


def run_guest_pytest(guest_dir: Path, selected_tests: list[str], all_tests: list[str], share: Path, *,
                     timeout: int, test_timeout: int = 600, lab_args: list[str] = (),
                     env: dict[str, str] | None = None, pytest_args: list[str] = ()) -> VmRun:
    """Boot the VM once and run the selected guest tests; never raises (the tests report)."""
    xml_path = share / "guest.xml"
    rel = guest_dir.relative_to(REPO)
    if sorted(selected_tests) == sorted(all_tests):
        targets = [str(rel)]  # whole dir: collection errors of any file are reported too
    else:
        targets = [f"{rel}/{t}" for t in selected_tests if not t.endswith("::<module>")]
    envs: list[str] = []
    # PYTHONPATH: every process the guest starts (supervisor, templates, workers with their cwd in an
    # app dir) imports numaserve from this checkout, as the guest pytest does from its cwd
    for k, v in {"NUMASERVE_IN_VM": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), **(env or {})}.items():
        envs += ["--env", f"{k}={v}"]
    cmd = [
        str(LAB_SCRIPT), "--cwd", str(REPO), "--timeout", str(timeout), "--share", str(share), *lab_args, *envs,
        # -n 0: one guest pytest process, whatever addopts say (the guest has 4 emulated vCPUs)
        "--", sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-rA",
        "--timeout", str(test_timeout), "-o", "junit_family=xunit2", f"--junitxml={xml_path}", *pytest_args, *targets,
    ]
    t0 = time.monotonic()
    rc, out, err = run_lab(cmd, timeout + 120)
    if rc is None:
        err += "\nhost: VM script timed out"
    seconds = time.monotonic() - t0
    (share / "vm-stdout.txt").write_text(out)
    (share / "vm-stderr.txt").write_text(err)
    run = VmRun(rc, seconds, out, err, xml_path, share)
    try:
        run.results, run.module_errors = parse_junit(xml_path.read_text(), {t.split("::")[0] for t in all_tests})
    except (OSError, ET.ParseError) as e:
        run.xml_error = f"{type(e).__name__}: {e}"
    print(f"\n[vm] {len(selected_tests)} guest test(s), VM exit {rc}, {seconds:.1f} s; output in {share}")
    return run


def report(vm_run: VmRun, guest_test: str) -> None:
    """Pass, fail or skip the host test the way its guest test ended."""
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


def extra_pytest_args() -> list[str]:
    return shlex.split(os.environ.get("NUMASERVE_VM_PYTEST_ARGS", ""))
