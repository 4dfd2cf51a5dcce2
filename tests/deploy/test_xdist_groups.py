"""tests/conftest.py's grouping reaches pytest-xdist: a module with a module fixture of its own runs on one worker.

The check is on this very run: under ``--dist loadgroup`` xdist marks a grouped test by suffixing
its node id with ``@<group>``; it only does so when the group marker was added before its own
collection hook ran (the bug of the first version: every module fixture was built once per worker).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from tests.conftest import pytest_xdist_auto_num_workers


@pytest.fixture(scope="module")
def built() -> list[str]:
    """A module fixture of this module's own: what makes conftest.py group the module."""
    return []


@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_module_with_a_module_fixture_of_its_own_is_one_group(request: pytest.FixtureRequest, built: list[str],
                                                                 n: int) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER") or not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not under pytest-xdist --dist loadgroup (e.g. -n 0)")
    module = request.node.nodeid.split("::", 1)[0]
    assert request.node.nodeid.endswith(f"@{module}"), request.node.nodeid


@pytest.mark.parametrize("markexpr", ["not slow and not vm", "", "slow or vm", "vm"])
def test_auto_workers_are_two_per_cpu_for_any_selection(markexpr: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    config = SimpleNamespace(getoption=lambda name, default=None: markexpr if name == "markexpr" else default)
    assert pytest_xdist_auto_num_workers(config) == 2 * len(os.sched_getaffinity(0))  # type: ignore[arg-type]
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert pytest_xdist_auto_num_workers(config) == 3  # type: ignore[arg-type]


def test_the_vm_modules_split_into_two_chains_and_every_named_module_exists() -> None:
    from pathlib import Path

    from tests.conftest import VM_GROUPS, vm_group

    root = Path(__file__).resolve().parents[2]
    modules = sorted(str(p.relative_to(root)) for p in (root / "tests" / "vm").glob("test_*.py"))
    assert set(VM_GROUPS) <= set(modules), f"stale entries: {set(VM_GROUPS) - set(modules)}"
    groups = {m: vm_group(m + "::test_x") for m in modules}
    assert set(groups.values()) == {"vm-a", "vm-b"}, groups
