"""numpy imported with a one-thread BLAS pool, wherever the model package imports it first.

Why: OpenBLAS starts its worker threads when numpy is imported, sized by
``OPENBLAS_NUM_THREADS`` / ``OMP_NUM_THREADS`` (numaserve sets them to the
slot's CPUs).  A warm template with threads cannot fork (its workers would
be exec'd, each with its own copy of the weights), so the model package
imports numpy with those variables at 1 for the duration of the import;
the worker then runs its forward passes on its own thread pool
(``engine.run``).  Numpy already imported by someone else is left as it is.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

from numaserve.workerenv import THREAD_POOL_VARS

__all__ = ["import_numpy"]


def import_numpy() -> ModuleType:
    """The numpy module, imported single-threaded if this is its first import."""
    if "numpy" in sys.modules:
        return sys.modules["numpy"]
    saved = {v: os.environ.get(v) for v in THREAD_POOL_VARS}
    os.environ.update({v: "1" for v in THREAD_POOL_VARS})
    try:
        import numpy
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
    return numpy
