"""Guest-side tests: run only INSIDE the NUMA lab VM (tests/vm/test_in_vm.py boots it).

On a normal host run these files are not even collected: the host harness
sets ``NUMASERVE_IN_VM=1`` in the guest, and without it every ``test_*.py``
here is ignored.  Inside the VM every guest test is skipped when the machine
has fewer than 2 NUMA nodes.

Fixtures for guest test authors: ``numa_nodes`` (online node ids) and
``node_cpus`` (node id -> tuple of its CPUs), both read from sysfs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

IN_VM = os.environ.get("NUMASERVE_IN_VM") == "1"
if not IN_VM:
    collect_ignore_glob = ["test_*.py"]

NODE_ROOT = Path("/sys/devices/system/node")


def _parse(text: str) -> tuple[int, ...]:
    from numaserve.cpulist import parse_list

    return parse_list(text)


def _fmt(ids: tuple[int, ...]) -> str:
    from numaserve.cpulist import format_list

    return format_list(ids) or "none"


def online_nodes() -> tuple[int, ...]:
    try:
        return _parse((NODE_ROOT / "online").read_text())
    except OSError:
        return ()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if len(online_nodes()) >= 2:
        return
    skip = pytest.mark.skip(reason=f"needs >= 2 NUMA nodes (online: {_fmt(online_nodes())})")
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def numa_nodes() -> tuple[int, ...]:
    return online_nodes()


@pytest.fixture(scope="session")
def node_cpus(numa_nodes: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    return {n: _parse((NODE_ROOT / f"node{n}" / "cpulist").read_text()) for n in numa_nodes}
