"""Guest side of tests/vm/test_model_vm.py: collected only INSIDE the NUMA lab VM
(the host sets ``NUMASERVE_IN_VM=1`` for the guest); skipped there with < 2 nodes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("NUMASERVE_IN_VM") != "1":
    collect_ignore_glob = ["test_*.py"]

NODE_ROOT = Path("/sys/devices/system/node")


def _nodes() -> tuple[int, ...]:
    from numaserve.cpulist import parse_list

    try:
        return parse_list((NODE_ROOT / "online").read_text())
    except OSError:
        return ()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if len(_nodes()) >= 2:
        return
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason=f"needs >= 2 NUMA nodes (online: {_nodes()})")
    for item in items:  # the hook sees the whole session: mark only the tests of this directory
        if here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def node_cpus() -> dict[int, tuple[int, ...]]:
    from numaserve.cpulist import parse_list

    return {n: parse_list((NODE_ROOT / f"node{n}" / "cpulist").read_text()) for n in _nodes()}
