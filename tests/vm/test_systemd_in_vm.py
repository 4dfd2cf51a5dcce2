"""Host side of the systemd VM tests: numaserve.service under a real systemd, ONE boot.

The lab VM boots with ``--init systemd`` (systemd 252 as PID 1, 2 NUMA nodes,
a NIC on node 1) and runs ``pytest tests/vm/systemd_guest``, which installs
and drives the unit the way README says; each guest test becomes one host
test (see vmlab.py).

numaserve is installed the way an operator would, from a wheel into a venv at
/opt/numaserve: the wheel is built here from this checkout, and pip installs
it into a venv made from the system Python inside a private mount namespace
where /opt is a staging directory (so shebangs and paths are /opt/numaserve,
and the host's /opt is never touched).  The guest bind-mounts the staging
directory at /opt/numaserve, and, because the VM has no network, the host's
installed dependencies read-only at /opt/numaserve-deps.  Everything the
``numaserve`` user runs is then world-readable and outside /root and /home.

Skipped where the lab cannot run (see vmlab.skip_marks) or when there is no
system Python of this Python's version to build the venv from.
``NUMASERVE_VM_TIMEOUT`` overrides the VM timeout (default 2400 s).  The
guest's measurements are printed and kept in the share directory
(timings.json), with the VM's output.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import vmlab
from vmlab import REPO, VmRun

GUEST_DIR = Path(__file__).resolve().parent / "systemd_guest"
VM_TIMEOUT = int(os.environ.get("NUMASERVE_VM_TIMEOUT", "2400"))
GUEST_TESTS = vmlab.guest_tests(GUEST_DIR)
BASE_PYTHON = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
# what the wheel is built from
SOURCES = ("numaserve", "systemd", "config", "setup.cfg", "pyproject.toml", "README.md")

_VENV_SCRIPT = r"""
set -eu
mount --bind "$STAGE" /opt                 # this mount namespace only
"$BASE_PYTHON" -m venv --without-pip /opt/numaserve
mkdir -p /opt/numaserve-deps
mount --bind "$DEPS" /opt/numaserve-deps
mount -o remount,bind,ro /opt/numaserve-deps   # the host's site-packages: never written
site=$(/opt/numaserve/bin/python3 -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
echo /opt/numaserve-deps > "$site/numaserve-deps.pth"
# --ignore-installed: the host's own (editable) numaserve is visible through the .pth;
# without it pip "upgrades" it, i.e. uninstalls it from the host's site-packages
/opt/numaserve/bin/python3 -m pip install -q --no-deps --no-index --ignore-installed --disable-pip-version-check "$WHEEL"
test -x /opt/numaserve/bin/numaserve
"""


def deps_dir() -> str:
    return sysconfig.get_paths()["purelib"]


def prepare_install(stage: Path) -> str | None:
    """Wheel + venv in ``stage`` (``stage/numaserve`` is the venv); an error text, or None."""
    src = stage / "src"
    src.mkdir()
    for name in SOURCES:
        p = REPO / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(p, src / name)
    wheels = stage / "wheel"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "--disable-pip-version-check", "-w", str(wheels), str(src)],
                       capture_output=True, text=True, timeout=300)
    found = sorted(wheels.glob("numaserve-*.whl"))
    if r.returncode != 0 or not found:
        return f"pip wheel failed (rc {r.returncode}): {r.stderr[-2000:]}"
    env = dict(os.environ, STAGE=str(stage), BASE_PYTHON=str(BASE_PYTHON), DEPS=deps_dir(), WHEEL=str(found[0]))
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", _VENV_SCRIPT],
                       capture_output=True, text=True, timeout=300, env=env)
    if r.returncode != 0:
        return f"venv/pip install failed (rc {r.returncode}): {r.stdout[-1000:]} {r.stderr[-2000:]}"
    shutil.rmtree(src)
    return None


@pytest.fixture(scope="module")
def sd_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> VmRun:
    """One systemd VM boot running the selected guest tests; never raises (tests report)."""
    share = tmp_path_factory.mktemp("vm-systemd")
    stage = tmp_path_factory.mktemp("sd-stage")
    err = prepare_install(stage)
    if err is not None:
        return VmRun(None, 0.0, "", err, share / "guest.xml", share, xml_error=f"could not prepare the install: {err}")
    run = vmlab.run_guest_pytest(
        GUEST_DIR, vmlab.selected(request, __name__, GUEST_TESTS), GUEST_TESTS, share,
        timeout=VM_TIMEOUT, test_timeout=900, lab_args=["--init", "systemd", "--mem-per-node", "768"],
        env={"NUMASERVE_SD_STAGE": str(stage), "NUMASERVE_SD_DEPS": deps_dir(), "NUMASERVE_SD_SHARE": str(share)},
        pytest_args=vmlab.extra_pytest_args(),
    )
    timings = share / "timings.json"
    if timings.exists():
        print("[vm] systemd timings:", json.dumps(json.loads(timings.read_text()), sort_keys=True))
    return run


@pytest.mark.parametrize("guest_test", GUEST_TESTS)
@pytest.mark.vm
@pytest.mark.slow
@pytest.mark.timeout(VM_TIMEOUT + 600)
@pytest.mark.skipif(not BASE_PYTHON.exists(), reason=f"no {BASE_PYTHON} to build the venv from")
@pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare (util-linux) not installed")
@vmlab.skip_all
def test_systemd_guest(sd_run: VmRun, guest_test: str) -> None:
    vmlab.report(sd_run, guest_test)


# ------------------------------------------------- harness self-tests (host, fast)


def test_systemd_guest_tests_are_found() -> None:
    assert "test_unit_guest.py::test_start_returns_only_when_every_slot_is_ready" in GUEST_TESTS
    assert GUEST_TESTS[0] == "test_unit_guest.py::test_install_the_readme_way"   # file order = run order


def test_systemd_guest_files_are_not_collected_outside_the_vm() -> None:
    if os.environ.get("NUMASERVE_IN_VM") == "1":
        pytest.skip("inside the VM")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "--collect-only", "-q", str(GUEST_DIR)],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env=dict(os.environ, NUMASERVE_IN_VM="1"),   # even with the flag: PID 1 here is not the lab's systemd
    )
    assert "test_unit_guest" not in r.stdout, r.stdout
