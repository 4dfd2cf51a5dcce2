"""The real machines' sysfs dumps (``../shared/fixtures/hwloc/*.tar.bz2``), extracted once per machine.

Each dump is ~5,500 files; extracting the six took 7.7 s of system time here, and every xdist
worker extracted all of them into pytest's basetemp on every run, which pytest then deleted three
runs later at exit (8-10 s after "passed", 90,000 files). The tests only read the trees, so a dump
is extracted once into a cache directory keyed by the tarball's content hash and reused by every
run and worker. A concurrent first extraction is safe: each extracts beside the cache and renames
into place; the loser uses the winner's tree.

NUMASERVE_HWLOC_DIR: the dumps elsewhere (a worktree whose ../shared is not beside it).
NUMASERVE_TEST_CACHE: where the extracted trees live (default ``$XDG_CACHE_HOME`` or ``~/.cache``,
``numaserve-tests/hwloc``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HWLOC_DIR = Path(os.environ.get("NUMASERVE_HWLOC_DIR") or REPO / ".." / "shared" / "fixtures" / "hwloc")


def cache_dir() -> Path:
    """Where extracted dumps are kept between runs."""
    explicit = os.environ.get("NUMASERVE_TEST_CACHE")
    if explicit:
        return Path(explicit) / "hwloc"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "numaserve-tests" / "hwloc"


def _extract_into(tarball: Path, dest: Path) -> None:
    if shutil.which("tar"):  # several times faster than tarfile on the 5,500-file dumps
        subprocess.run(["tar", "xjf", str(tarball), "-C", str(dest), "--no-same-owner"], check=True)
    else:
        with tarfile.open(tarball, "r:bz2") as tf:
            tf.extractall(dest, filter="data")


def extracted(name: str) -> Path:
    """name → the directory holding ``sys/`` of that dump (read-only use); skips the test when absent."""
    tarball = HWLOC_DIR / f"{name}.tar.bz2"
    if not tarball.is_file():
        pytest.skip(f"hwloc fixture {tarball} not present")
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()[:16]
    final = cache_dir() / f"{name}-{digest}"
    if not final.is_dir():
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
        try:
            _extract_into(tarball, staging)
            os.rename(staging, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    roots = [p.parent for p in final.glob("*/sys") if p.is_dir()] + [p.parent for p in final.glob("sys")]
    assert len(roots) == 1, f"{tarball}: expected one folder with sys/, found {roots} in {final}"
    return roots[0]
