"""constraints.txt: exact pins for every dependency setup.cfg names, used by scripts/install and the Dockerfile."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
from pathlib import Path

import pytest

packaging = pytest.importorskip("packaging.requirements")
from packaging.requirements import Requirement  # noqa: E402
from packaging.utils import canonicalize_name  # noqa: E402
from packaging.version import Version  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXTRAS = ("test", "bench")


def pins() -> dict[str, str]:
    out: dict[str, str] = {}
    for n, line in enumerate((REPO / "constraints.txt").read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", line)
        assert m, f"constraints.txt:{n}: {line!r}: expected NAME==VERSION"
        name = canonicalize_name(m.group(1))
        assert name not in out, f"constraints.txt:{n}: {name} pinned twice"
        out[name] = m.group(2)
    return out


def declared() -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    for extra in EXTRAS:
        lines += cfg["options.extras_require"][extra].splitlines()
    return [Requirement(x.strip()) for x in lines if x.strip() and not x.strip().startswith("#")]


def test_every_declared_dependency_is_pinned_within_its_range() -> None:
    have = pins()
    for req in declared():
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        assert name in have, (f"{req.name} (setup.cfg) is not in constraints.txt: run ./scripts/install, "
                              "then scripts/constraints > constraints.txt")
        assert req.specifier.contains(Version(have[name]), prereleases=True), \
            f"constraints.txt pins {name}=={have[name]}, outside setup.cfg's {req}"


def test_install_and_image_install_with_the_constraints() -> None:
    install = (REPO / "scripts" / "install").read_text()
    assert re.search(r"pip install .*-c constraints\.txt -e '\.\[test,bench\]'", install)
    docker = (REPO / "Dockerfile").read_text()
    assert re.search(r"^COPY [^\n]*\bconstraints\.txt\b[^\n]* /src/$", docker, re.M)
    assert re.search(r"pip install [^\n]*-c /src/constraints\.txt /src$", docker, re.M)


def test_the_generator_runs_and_pins_exactly() -> None:
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "constraints")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    body = [x for x in r.stdout.splitlines() if x and not x.startswith("#")]
    assert body and all(re.fullmatch(r"[a-z0-9-]+==\S+", x) for x in body), body
    assert "numaserve==" not in r.stdout and "click==" in r.stdout


def test_the_plugins_addopts_need_are_declared_test_dependencies() -> None:
    """setup.cfg's addopts use pytest-xdist (-n, --dist): without it in the test extra a fresh install cannot run pytest."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    addopts = cfg["tool:pytest"]["addopts"].split()
    test_extra = {canonicalize_name(Requirement(x.strip()).name)
                  for x in cfg["options.extras_require"]["test"].splitlines()
                  if x.strip() and not x.strip().startswith("#")}
    if "-n" in addopts or "--dist" in addopts:
        assert "pytest-xdist" in test_extra, "addopts use -n/--dist: add pytest-xdist to setup.cfg's test extra"
        assert "pytest-xdist" in pins(), "pin pytest-xdist in constraints.txt"
