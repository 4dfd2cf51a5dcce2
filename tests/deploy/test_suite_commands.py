"""The test commands a newcomer reads (README.md, docs/testing.md) are the ones CI runs and the markers exist."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAST = 'python3 -m pytest -m "not slow and not vm"'


def registered_markers() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return {line.split(":", 1)[0].strip() for line in cfg["tool:pytest"]["markers"].splitlines() if line.strip()}


def test_ci_runs_the_readme_test_command() -> None:
    readme = (REPO / "README.md").read_text()
    setup = re.search(r"## Set up\n+```sh\n(.*?)```", readme, re.S)
    assert setup, "README.md has no '## Set up' sh block"
    commands = [line.split("#", 1)[0].strip() for line in setup.group(1).splitlines()]
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert "./scripts/install" in commands and "./scripts/install" in ci
    suite = [c for c in commands if c.startswith("python3 -m pytest")]
    assert suite and suite[0] in ci, f"README's test command {suite} is not what .ci/run runs: {ci}"


def test_the_fast_command_is_documented_and_names_registered_markers() -> None:
    for doc in ("README.md", "docs/testing.md"):
        assert FAST in (REPO / doc).read_text(), f"{doc} does not show the fast command {FAST!r}"
    expression = FAST.split('"')[1]
    named = set(re.findall(r"\b(?!not\b|and\b|or\b)(\w+)", expression))
    assert named and named <= registered_markers(), (named, registered_markers())
