"""The optional preload hook (``[worker] preload`` / ``--preload module:function``).

Runs once per process that imports the app, right after the import: in a
node's warm template (so what it allocates, e.g. model weights, lands in
that node's memory and is shared copy-on-write by every worker forked from
it), or in an exec'd worker (so the app sees the same state either way).
A failure is one line, like an app that does not import.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import time
from typing import Any

from numaserve.worker.appload import describe_exception, import_attr

__all__ = ["PRELOAD_RE", "PreloadError", "preload_done", "run_preload"]

PRELOAD_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

#: Hooks already run in this process (a forked worker inherits its template's).
_done: dict[str, float] = {}


class PreloadError(Exception):
    """The hook could not be found or raised; ``str()`` is one line."""


def preload_done(ref: str) -> bool:
    return ref in _done


def run_preload(ref: str) -> float:
    """Call ``module:function`` (an ``async def`` is run to completion); returns its duration in s.

    A second call for the same hook in the same process does nothing (returns 0).
    """
    if not ref or ref in _done:
        return 0.0
    if not PRELOAD_RE.match(ref):
        raise PreloadError(f"bad preload reference {ref!r}: expected 'module:function'")
    module_name, _, attr_path = ref.partition(":")
    t0 = time.monotonic()
    obj = import_attr(module_name, attr_path, PreloadError, "preload module ")
    if not callable(obj):
        raise PreloadError(f"TypeError: preload {ref!r} is a {type(obj).__name__}, not a function")
    try:
        result = obj()
        if inspect.isawaitable(result):
            asyncio.run(_await(result))
    except BaseException as e:  # the hook may raise anything
        if isinstance(e, KeyboardInterrupt):
            raise
        raise PreloadError(f"{describe_exception(e)} (running preload {ref!r})") from e
    took = time.monotonic() - t0
    _done[ref] = took
    return took


async def _await(aw: Any) -> Any:
    return await aw
