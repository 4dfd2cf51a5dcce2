"""`numaserve config check`: every error start would refuse, each with file:line, and "did you mean".

Through the real console script, as CI or config management runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from numaserve.cli.config_check import key_line

REPO = Path(__file__).resolve().parents[2]


def check(path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("NUMASERVE_")}
    e.update(env, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "numaserve", "config", "check", str(path)], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=120)


def test_every_error_with_its_line_and_the_closest_key(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("# numaserve\n[server]\nbacklogg = 10\ngraceful_timeout = -1\n\n"
                 "[placement]\nworkers_per_node = 0\n\n[supervisr]\nready_timeout = 5\n")
    r = check(p)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    lines = r.stderr.splitlines()
    assert "Traceback" not in r.stderr
    assert lines[0].startswith(f"numaserve: error: {p}:3: unknown key server.backlogg = 10 (did you mean backlog?)")
    assert lines[1].startswith(f"numaserve: error: {p}:4: server.graceful_timeout = -1.0: expected a number >= 0")
    assert lines[2].startswith(f"numaserve: error: {p}:7: placement.workers_per_node = 0: expected an integer >= 1")
    assert lines[3].startswith(f"numaserve: error: {p}:9: unknown section [supervisr] (did you mean supervisor?)")
    assert lines[4] == f"numaserve: error: {p}: 4 errors"


def test_a_bind_address_this_machine_does_not_have_is_refused_as_start_refuses_it(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[server]\nbind = ["127.0.0.1:0", "192.0.2.77:8000"]\n')   # TEST-NET-1: never local
    r = check(p)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"numaserve: error: {p}:2: server.bind 192.0.2.77:8000: cannot bind: "
                                "Cannot assign requested address (this machine has no such address)")


def test_a_port_in_use_does_not_fail_the_check(tmp_path: Path) -> None:
    """A running supervisor holds its port: checking its config before a reload must pass."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        p = tmp_path / "c.toml"
        p.write_text(f'[server]\nbind = ["127.0.0.1:{s.getsockname()[1]}"]\n')
        r = check(p)
    assert r.returncode == 0 and r.stdout == f"{p}: ok\n", r.stderr


def test_an_environment_error_names_the_variable(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[server]\nbacklog = 10\n")
    r = check(p, NUMASERVE_SERVER_BACKLOG="-3", NUMASERVE_SERVER_READ_TIMEOUT="-1")
    assert r.returncode == 2
    assert set(r.stderr.splitlines()[:2]) == {
        "numaserve: error: environment NUMASERVE_SERVER_BACKLOG: server.backlog = -3: expected an integer > 0",
        "numaserve: error: environment NUMASERVE_SERVER_READ_TIMEOUT: server.read_timeout = -1.0: "
        "expected a number >= 0"}, r.stderr


def test_a_cmd_template_start_refuses_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[server]\nbind = ["127.0.0.1:0"]\ncmd = "uvicorn app:app --port {port}"\n')  # start refuses it
    r = check(p)
    assert r.returncode == 2 and f"{p}:3: server.cmd uses {{port}}" in r.stderr, r.stderr


@pytest.mark.parametrize("text, section, key, line", [
    ("[server]\nbacklog = 1\n", "server", "backlog", 2),
    ("[log]\nbacklog = 1\n[server]\n  backlog=1\n", "server", "backlog", 4),
    ('server.backlog = 1\n[log]\nlevel = "x"\n', "server", "backlog", 1),
    ('[server]\n"backlog" = 1\n', "server", "backlog", 2),
    ("[a]\nx = 1\n[nope]\n", "nope", "", 3),
    ("[server]\nbind = [\n  'x',\n]\n", "server", "missing", 1),   # not found: the table's header
    ("[[node]]\nbacklog = 1\n", "server", "backlog", None),
])
def test_key_line(text: str, section: str, key: str, line: int | None) -> None:
    assert key_line(text, section, key) == line
