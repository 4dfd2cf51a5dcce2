"""`numaserve top` in a real terminal (tmux): q quits, Ctrl-C quits, the terminal is given back."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import REPO, Running, numaserve_argv

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")]


@pytest.fixture(scope="module")
def sup() -> Iterator[Running]:
    with Running(["--nodes", "0", "--workers-per-node", "1", "--bind", "127.0.0.1:0"]) as s:
        yield s


def tmux(sock: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tmux", "-L", sock, *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("key", ["q", "C-c"])
def test_top_quits_on_a_key(sup: Running, key: str, tmp_path: Path) -> None:
    sock = f"ns-top-{os.getpid()}-{key}"
    rc = tmp_path / "rc"
    cmd = " ".join(numaserve_argv("top", "--runtime-dir", str(sup.rt)))
    env = f"PYTHONPATH={REPO}"
    r = tmux(sock, "new-session", "-d", "-s", "top", "-x", "120", "-y", "40", "-c", str(REPO),
             f"sh -c 'trap : INT; {env} {cmd}; echo $? > {rc}; sleep 60'")  # the shell outlives Ctrl-C
    assert r.returncode == 0, r.stderr
    try:
        deadline = time.monotonic() + 60
        while "numaserve top" not in tmux(sock, "capture-pane", "-p", "-t", "top").stdout:
            assert time.monotonic() < deadline, tmux(sock, "capture-pane", "-p", "-t", "top").stdout
            time.sleep(0.2)
        tmux(sock, "send-keys", "-t", "top", key)
        while not rc.exists():
            assert time.monotonic() < deadline, f"top still running after {key}"
            time.sleep(0.2)
        assert rc.read_text().strip() == "0"
        # the terminal is back in its normal mode: a typed line echoes
        tmux(sock, "send-keys", "-t", "top", "echo-check")
        deadline = time.monotonic() + 30
        while "echo-check" not in tmux(sock, "capture-pane", "-p", "-t", "top").stdout:
            assert time.monotonic() < deadline, "terminal left without echo"
            time.sleep(0.2)
    finally:
        tmux(sock, "kill-server")
