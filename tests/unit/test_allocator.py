"""Allocator options: MALLOC_ARENA_MAX, jemalloc detection/LD_PRELOAD, and the slot environment."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from numaserve.bind.allocator import AllocatorConfig, allocator_env, check_allocator, find_jemalloc, jemalloc_paths
from numaserve.config import Config
from numaserve.errors import ConfigError
from numaserve.bind.placement import SlotPlan
from numaserve.supervisor.spawn import numaserve_env


def test_defaults_set_arena_max_only() -> None:
    assert allocator_env(AllocatorConfig(), {}) == {"MALLOC_ARENA_MAX": "2"}
    assert allocator_env(AllocatorConfig(malloc_arena_max=0), {}) == {}


def test_jemalloc_is_preloaded_before_existing_preloads(tmp_path: Path) -> None:
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    env = allocator_env(AllocatorConfig(jemalloc=True, malloc_arena_max=0), {"LD_PRELOAD": "/x/liba.so"},
                        paths=[str(tmp_path / "nope.so"), str(lib)])
    assert env == {"LD_PRELOAD": f"{lib} /x/liba.so"}
    assert find_jemalloc([str(lib)]) == str(lib)


def test_missing_jemalloc_is_a_clear_error_naming_the_paths(tmp_path: Path) -> None:
    paths = [str(tmp_path / "a" / "libjemalloc.so.2"), str(tmp_path / "b" / "libjemalloc.so.2")]
    with pytest.raises(ConfigError) as ei:
        check_allocator(AllocatorConfig(jemalloc=True), paths)
    msg = str(ei.value)
    assert "allocator.jemalloc" in msg and paths[0] in msg and paths[1] in msg and "libjemalloc2" in msg
    with pytest.raises(ConfigError):
        check_allocator(AllocatorConfig(malloc_arena_max=-1))


def test_default_search_paths_are_absolute_and_unique() -> None:
    paths = jemalloc_paths()
    assert all(os.path.isabs(p) and p.endswith("libjemalloc.so.2") for p in paths)
    assert len(paths) == len(set(paths))


def test_slot_environment_includes_allocator_but_env_section_wins() -> None:
    plan = SlotPlan(slot=0, node=0, index=0, cpus=(0,), mempolicy="bind", memory_nodes=(0,))
    env = numaserve_env(Config(), {}, plan, 1)
    assert env["MALLOC_ARENA_MAX"] == "2"
    cfg = Config()
    cfg.env.vars["MALLOC_ARENA_MAX"] = "8"
    assert numaserve_env(cfg, {}, plan, 1)["MALLOC_ARENA_MAX"] == "8"
