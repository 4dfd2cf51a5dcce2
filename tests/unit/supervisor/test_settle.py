"""The supervisor's one-shot trim of its start-up garbage (numaserve.supervisor.settle)."""

from __future__ import annotations

import asyncio

from numaserve.memtrim import malloc_trim
from numaserve.supervisor.settle import trim_once_settled


def test_trims_once_when_the_supervisor_first_serves() -> None:
    states = iter(["starting", "starting", "running", "running"])
    trims: list[int] = []

    def trim() -> bool:
        trims.append(1)
        return True

    async def run() -> bool:
        return await trim_once_settled(lambda: next(states), poll_s=0.001, trim=trim)

    assert asyncio.run(run()) is True
    assert trims == [1]
    assert next(states) == "running"  # stopped asking once settled: one state left over


def test_degraded_counts_as_settled_and_a_start_that_never_settles_never_trims() -> None:
    trims: list[int] = []

    async def run(state: str, limit: float) -> bool:
        return await trim_once_settled(lambda: state, poll_s=0.001, limit_s=limit,
                                       trim=lambda: bool(trims.append(1)))

    assert asyncio.run(run("degraded", 5.0)) is True and trims == [1]
    assert asyncio.run(run("starting", 0.02)) is False and trims == [1]


def test_malloc_trim_reaches_glibc() -> None:
    import platform

    got = malloc_trim()
    if platform.libc_ver()[0] == "glibc":
        assert isinstance(got, bool)  # called, not skipped as "no glibc"
    else:
        assert got is None or isinstance(got, bool)
