"""Memory-allocator options for workers: glibc arenas, jemalloc, ``gc.freeze()``.

* ``malloc_arena_max``: glibc creates up to 8 x cores malloc arenas, one per
  contending thread; for a worker pinned to a few CPUs that mostly means
  fragmentation and RSS growth that looks like a leak.  Set through the
  ``MALLOC_ARENA_MAX`` environment variable (0 = leave it unset).
* ``jemalloc``: ``LD_PRELOAD`` of ``libjemalloc.so.2`` (Debian:
  ``libjemalloc2``).  Asked for but not installed is a config error naming
  the paths searched, never a silent fallback.
* ``gc_freeze``: the worker calls ``gc.freeze()`` right after importing the
  app, so the objects made at import are never scanned by the cyclic GC
  again (shorter collections, fewer pages dirtied).

The environment part is computed in the supervisor (``allocator_env``) and
is shown with the rest of a slot's environment in ``plan`` and ``status``.
"""

from __future__ import annotations

import os
import sysconfig
from typing import Mapping, Sequence

from numaserve.config import AllocatorConfig
from numaserve.errors import ConfigError

__all__ = ["AllocatorConfig", "allocator_env", "check_allocator", "find_jemalloc", "jemalloc_paths"]


def jemalloc_paths() -> list[str]:
    """Where ``libjemalloc.so.2`` is looked for, in order."""
    dirs: list[str] = []
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        dirs.append(f"/usr/lib/{multiarch}")
    dirs += ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
             "/usr/local/lib"]
    seen: list[str] = []
    for d in dirs:
        p = os.path.join(d, "libjemalloc.so.2")
        if p not in seen:
            seen.append(p)
    return seen


def find_jemalloc(paths: Sequence[str] | None = None) -> str | None:
    """The first existing jemalloc library, or None."""
    for p in jemalloc_paths() if paths is None else paths:
        if os.path.isfile(p):
            return p
    return None


def check_allocator(cfg: AllocatorConfig, paths: Sequence[str] | None = None) -> None:
    """Raise ``ConfigError`` for values that cannot work (before any worker starts)."""
    if cfg.malloc_arena_max < 0:
        raise ConfigError(f"allocator.malloc_arena_max = {cfg.malloc_arena_max}: expected an integer >= 0 "
                          "(0 = leave MALLOC_ARENA_MAX unset)")
    if cfg.jemalloc and find_jemalloc(paths) is None:
        searched = ", ".join(jemalloc_paths() if paths is None else paths)
        raise ConfigError("allocator.jemalloc = true but libjemalloc.so.2 is not installed (searched "
                          f"{searched}); install it (Debian: apt-get install libjemalloc2) or set jemalloc = false")


def allocator_env(cfg: AllocatorConfig, inherited: Mapping[str, str],
                  paths: Sequence[str] | None = None) -> dict[str, str]:
    """Variables to set for a worker (raises ``ConfigError`` like ``check_allocator``)."""
    check_allocator(cfg, paths)
    env: dict[str, str] = {}
    if cfg.malloc_arena_max > 0:
        env["MALLOC_ARENA_MAX"] = str(cfg.malloc_arena_max)
    if cfg.jemalloc:
        lib = find_jemalloc(paths)
        assert lib is not None
        old = [p for p in inherited.get("LD_PRELOAD", "").replace(":", " ").split() if p != lib]
        env["LD_PRELOAD"] = " ".join([lib, *old])
    return env
