"""`numaserve start` with uvicorn/gunicorn habits, through the real console script: what it refuses,
in one line with exit status 2, before anything listens (the serving side: tests/integration/
test_serving_habits.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NUMASERVE = shutil.which("numaserve")
pytestmark = pytest.mark.skipif(NUMASERVE is None, reason="numaserve console script not on PATH")


def start(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "empty.toml"
    cfg.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMASERVE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    argv = [str(NUMASERVE), "start", *args, "--config", str(cfg), "--runtime-dir", str(tmp_path / "rt"),
            "--bind", "127.0.0.1:0", "--nodes", "0"]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=str(tmp_path))


def one_line(r: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert all(f in lines[0] for f in fragments), lines[0]


def test_the_app_given_twice_is_refused(tmp_path: Path) -> None:
    r = start(tmp_path, "myapp:app", "--app", "other:app")
    one_line(r, "the app is given twice", "'myapp:app'", "'other:app'")


def test_the_app_argument_and_cmd_exclude_each_other(tmp_path: Path) -> None:
    one_line(start(tmp_path, "myapp:app", "--cmd", "sleep 1"), "--app and --cmd")


def test_a_bad_app_argument_names_the_key(tmp_path: Path) -> None:
    one_line(start(tmp_path, "not an app"), "flag --app", "server.app", "module:attribute")


@pytest.mark.parametrize("args, fragments", [
    (["--access-log-format", "%(x)s"], ["flag --access-log-format", "server.access_log_format", "unknown field %(x)s"]),
    (["--root-path", "api/"], ["flag --root-path", "server.root_path", "leading /"]),
    (["--forwarded-allow-ips", "10.0.0.1, nope"], ["flag --forwarded-allow-ips", '"nope"']),
    (["--max-requests-jitter", "5"], ["flag --max-requests-jitter", "worker.max_requests set too"]),
    (["--max-requests", "-1"], ["--max-requests", "-1"]),
    (["--max-lifetime", "nan"], ["--max-lifetime", "nan"]),
    (["--timeout-keep-alive", "-3"], ["--timeout-keep-alive"]),
    (["--log-level", "loud"], ["--log-level", "loud"]),
])
def test_bad_habit_flags_are_one_line_errors(tmp_path: Path, args: list[str], fragments: list[str]) -> None:
    r = start(tmp_path, *args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert all(f in r.stderr for f in fragments), r.stderr
