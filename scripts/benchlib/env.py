"""Where things are, which peers we run, and what machine the numbers come from."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
APP_DIR = REPO / "scripts" / "bench_apps"
DOCS = REPO / "docs" / "benchmarks"

#: What the bench needs beyond numaserve's own dependencies, installed on demand.
PEER_PACKAGES = ("gunicorn", "matplotlib")

_worker_class: str | None = None


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:
        return False


def _pip_install(*pkgs: str) -> None:
    print(f"bench: pip install {' '.join(pkgs)}", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *pkgs], check=True)
    importlib.invalidate_caches()


def ensure_peers(install: bool = True) -> dict[str, str]:
    """Make gunicorn, a gunicorn UvicornWorker class and matplotlib importable.

    The worker class operators name today is ``uvicorn.workers.UvicornWorker``;
    uvicorn still ships it (deprecated since 0.30 in favour of the
    ``uvicorn-worker`` package).  We use it while it imports and fall back to
    ``uvicorn_worker.UvicornWorker`` (installing ``uvicorn-worker``) when it
    does not.  Returns what was chosen.
    """
    global _worker_class
    missing = [p for p in PEER_PACKAGES if not _importable(p)]
    if missing:
        if not install:
            raise SystemExit(f"bench: missing {', '.join(missing)} (run without --no-install, or "
                             f"pip install {' '.join(missing)})")
        _pip_install(*missing)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if _importable("uvicorn.workers"):
            _worker_class = "uvicorn.workers.UvicornWorker"
        else:
            if not _importable("uvicorn_worker"):
                if not install:
                    raise SystemExit("bench: uvicorn.workers is gone; pip install uvicorn-worker")
                _pip_install("uvicorn-worker")
            _worker_class = "uvicorn_worker.UvicornWorker"
    return {"gunicorn_worker_class": _worker_class}


def peer_worker_class() -> str:
    if _worker_class is None:
        ensure_peers(install=False)
    assert _worker_class is not None
    return _worker_class


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info() -> dict[str, Any]:
    """Everything a reader needs to judge the numbers (taken at the start of a run)."""
    mem = None
    try:
        import psutil

        mem = psutil.virtual_memory().total
    except Exception:
        pass
    git = None
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=5).stdout.strip() or None
    except Exception:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpus_allowed": sorted(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "memory_bytes": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "packages": {d: _version(d) for d in ("numaserve", "uvicorn", "gunicorn", "uvicorn-worker", "uvloop",
                                               "httptools", "psutil", "matplotlib")},
        "git_commit": git,
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
