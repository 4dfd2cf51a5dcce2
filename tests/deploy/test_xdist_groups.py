"""tests/conftest.py's grouping reaches pytest-xdist: a module with a module fixture of its own runs on one worker.

The check is on this very run: under ``--dist loadgroup`` xdist marks a grouped test by suffixing
its node id with ``@<group>``; it only does so when the group marker was added before its own
collection hook ran (the bug of the first version: every module fixture was built once per worker).
"""

from __future__ import annotations

import os

import pytest


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
