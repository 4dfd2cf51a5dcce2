"""glibc's ``malloc_trim(0)``: free heap pages back to the kernel.

Why a module of its own: the supervisor trims once it has settled
(``numaserve.supervisor.settle``) and a warm template trims before its first
fork (``numaserve.worker.template``); both call this one function, and the
worker must not import the supervisor to reach it.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["malloc_trim"]


def malloc_trim() -> bool | None:
    """glibc's ``malloc_trim(0)``: True when memory went back to the kernel, None without glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return None
