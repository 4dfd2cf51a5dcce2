"""Global options after the subcommand, and unknown flags pointing to numaserve's equivalent.

Through the real console script (``python -m numaserve``), as an operator types it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def numaserve(*args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMASERVE_")}
    env["PYTHONPATH"] = str(REPO)
    empty = tmp_path / "empty.toml"
    empty.touch()
    env["NUMASERVE_CONFIG"] = str(empty)
    return subprocess.run([sys.executable, "-m", "numaserve", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("argv", [
    ["config", "show", "--log-level", "debug", "--json"],
    ["--log-level", "debug", "config", "show", "--json"],
    ["--log-level", "error", "config", "show", "--log-level", "DEBUG", "--json"],  # after the command wins
])
def test_log_level_before_or_after_the_command(argv: list[str], tmp_path: Path) -> None:
    r = numaserve(*argv, tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["log"]["level"] == "debug"


def test_log_level_after_status_and_start_is_accepted(tmp_path: Path) -> None:
    r = numaserve("status", "--log-level", "debug", "--runtime-dir", str(tmp_path / "none"), tmp_path=tmp_path)
    assert "No such option" not in r.stderr and "no supervisor is running" in r.stderr, r.stderr
    r = numaserve("start", "--log-level", "debug", "--bind", "300.1.1.1:80", tmp_path=tmp_path)
    assert r.returncode == 2 and "No such option" not in r.stderr, r.stderr
    assert "300.1.1.1" in r.stderr


def test_log_level_of_a_group_subcommand(tmp_path: Path) -> None:
    r = numaserve("ratelimit", "show", "--log-level", "warning", "--runtime-dir", str(tmp_path / "none"),
                  tmp_path=tmp_path)
    assert "No such option" not in r.stderr and "no supervisor is running" in r.stderr, r.stderr


@pytest.mark.parametrize("flag, says, never", [
    ("--reload", "numaserve reload", "--preload"),
    ("--workers", "--workers-per-node", "Did you mean"),
    ("--host", "--bind HOST:PORT", "Did you mean"),
    ("--fd", '--cmd "uvicorn app:app --fd {fd}"', "Did you mean"),
    ("--timeout", "server.graceful_timeout", "Did you mean"),
])
def test_uvicorn_and_gunicorn_flags_name_the_numaserve_way(flag: str, says: str, never: str, tmp_path: Path) -> None:
    r = numaserve("start", flag, "1", tmp_path=tmp_path)
    assert r.returncode == 2
    assert f"No such option '{flag}'" in r.stderr and says in r.stderr, r.stderr
    assert never not in r.stderr and "Traceback" not in r.stderr


def test_a_longer_flag_is_not_offered_its_prefix(tmp_path: Path) -> None:
    r = numaserve("topology", "--root-path", "/x", tmp_path=tmp_path)
    assert r.returncode == 2 and "No such option '--root-path'" in r.stderr, r.stderr
    assert "'--root'" not in r.stderr


def test_a_typo_still_gets_its_suggestion(tmp_path: Path) -> None:
    r = numaserve("start", "--log-levl", "debug", tmp_path=tmp_path)
    assert r.returncode == 2 and "Did you mean '--log-level'?" in r.stderr, r.stderr
