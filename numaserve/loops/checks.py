"""Range checks for the controllers' settings, with errors that name the key.

Every ``__post_init__`` of a settings Struct in ``numaserve.loops`` calls these,
so a bad value is refused wherever the Struct is built (config file, flag,
environment, a test).  The message is ``KEY = VALUE: expected WHAT``; the config
loader adds the section and the source (``numaserve.config``).  Comparisons are
written so that NaN fails every one of them.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["SettingError", "at_least", "between", "fraction", "ordered", "positive"]


class SettingError(ValueError):
    """One setting out of range: ``key``, ``value`` and what was expected."""

    def __init__(self, key: str, value: Any, expected: str) -> None:
        super().__init__(f"{key} = {value!r}: expected {expected}")
        self.key = key
        self.value = value
        self.expected = expected


def _finite(key: str, value: float) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise SettingError(key, value, "a finite number")


def positive(obj: Any, *keys: str) -> None:
    """Each key > 0 and finite."""
    for k in keys:
        v = getattr(obj, k)
        _finite(k, v)
        if not v > 0:
            raise SettingError(k, v, "a number > 0")


def at_least(obj: Any, minimum: float, *keys: str) -> None:
    """Each key >= minimum and finite."""
    for k in keys:
        v = getattr(obj, k)
        _finite(k, v)
        if not v >= minimum:
            raise SettingError(k, v, f"a number >= {minimum:g}")


def fraction(obj: Any, *keys: str, low_open: bool = False, high_open: bool = False) -> None:
    """Each key in [0, 1] (ends open as asked)."""
    for k in keys:
        v = getattr(obj, k)
        _finite(k, v)
        lo_ok = v > 0 if low_open else v >= 0
        hi_ok = v < 1 if high_open else v <= 1
        if not (lo_ok and hi_ok):
            raise SettingError(k, v, f"a number in {'(' if low_open else '['}0, 1{')' if high_open else ']'}")


def between(obj: Any, key: str, low: float, high: float) -> None:
    """``low <= key <= high`` and finite."""
    v = getattr(obj, key)
    _finite(key, v)
    if not low <= v <= high:
        raise SettingError(key, v, f"a number in [{low:g}, {high:g}]")


def ordered(obj: Any, low_key: str, high_key: str) -> None:
    """``low_key <= high_key`` (a floor above its ceiling is refused, naming the floor)."""
    lo, hi = getattr(obj, low_key), getattr(obj, high_key)
    if not lo <= hi:
        raise SettingError(low_key, lo, f"at most {high_key} ({hi!r})")
