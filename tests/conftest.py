"""How the suite shares a machine with itself under pytest-xdist (``-n auto --dist loadgroup`` in setup.cfg).

- Tests are spread one by one, except that a module whose tests share a module- or session-scoped
  fixture of its own (a supervisor, a VM boot, a quick bench run) runs on one worker, so the
  fixture is built once, not once per worker.
- The ``vm`` tests run in two groups ("vm-a", "vm-b"), two VMs at a time at most, and each VM
  module boots its VM once (the lab runs each VM in its own network namespace).

Nothing here keeps a neighbour off a test: a test that offers load does so relative to a ceiling
it cannot exceed however idle the machine is (see test_admission.py), never to a capacity
measured under the same noise.
"""

from __future__ import annotations

import os
import sys

import pytest

# Bytecode caches are written for this run even under PYTHONDONTWRITEBYTECODE (this dev box sets
# it): without them every xdist worker compiles numaserve and re-rewrites every test module's
# asserts on every run, 15-17 s of CPU per worker, a quarter of the fast command.  The caches go to
# the tree's __pycache__ directories (git-ignored); a read-only tree just skips them.
# NUMASERVE_TEST_NO_BYTECODE=1 keeps the environment's choice.
if not os.environ.get("NUMASERVE_TEST_NO_BYTECODE"):
    sys.dont_write_bytecode = False

#: The VM modules in two chains of about equal length. Seconds of guest tests each took in a
#: whole-suite run (TCG, 2 CPUs, 2026-12-07, after the systemd guest's workers fork from their
#: template): systemd 403-421, locality 124-125 | cpuset ~140, binding 96-104, model 39-55,
#: template 20. The vm-b chain without locality ended 230 s after vm-a. A module not named here is "vm-b".
VM_GROUPS = {"tests/vm/test_systemd_in_vm.py": "vm-a", "tests/vm/test_locality_vm.py": "vm-a"}


def vm_group(nodeid: str) -> str:
    """The xdist group of a ``vm`` test: its module's chain."""
    return VM_GROUPS.get(nodeid.split("::", 1)[0], "vm-b")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Workers for ``-n auto`` (setup.cfg): two per CPU, for the unit tests as for the whole suite.

    Neither keeps a worker's CPU busy: the slow tests wait on processes they started (a 'slow or vm'
    run on 2 workers used 0.78 CPU on average), and a third of the unit tests' time is sleeps,
    sockets and subprocesses (the fast command on 2 CPUs: 1.0 CPU busy on average with 2 workers,
    59-63 s; 52 s with 3, 47-49 s with 4, 51-53 s with 6, each extra worker paying ~5 s of CPU to
    import and collect). PYTEST_XDIST_AUTO_NUM_WORKERS overrides, as in xdist's own rule.
    """
    forced = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if forced:
        return int(forced)
    return 2 * len(os.sched_getaffinity(0))


def _own_module_scoped(item: pytest.Item) -> bool:
    """True when the item uses a module/session fixture defined in its own test module."""
    info = getattr(item, "_fixtureinfo", None)
    module = getattr(item, "module", None)
    if info is None or module is None:
        return False
    return any(d.scope in ("module", "session") and getattr(d.func, "__module__", None) == module.__name__
               for defs in info.name2fixturedefs.values() for d in defs)


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook, which turns the marker into the "@group" nodeid suffix
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group the VM tests, and each module's tests that share a module fixture of their own (see above)."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        if item.get_closest_marker("vm"):
            item.add_marker(pytest.mark.xdist_group(vm_group(item.nodeid)))
        elif _own_module_scoped(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
