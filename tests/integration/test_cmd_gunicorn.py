"""README's gunicorn `--cmd` example, run as written with two slots: two masters, no shared control socket.

gunicorn 27 opens ``~/.gunicorn/gunicorn.ctl`` by default; two masters (one
per slot) both claimed it.  The example turns it off.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.integration.harness import REPO, Running

pytest.importorskip("gunicorn")
pytest.importorskip("uvicorn.workers")

pytestmark = pytest.mark.slow   # two gunicorn masters under a real supervisor


def readme_gunicorn_cmd() -> str:
    text = (REPO / "README.md").read_text()
    m = re.search(r'--cmd "(gunicorn [^"]*)"', text)
    assert m, "README has no gunicorn --cmd example"
    return m.group(1)


def test_readme_gunicorn_example_serves_on_two_slots_without_a_shared_control_socket(tmp_path: Path) -> None:
    cmd = readme_gunicorn_cmd()
    assert "fd://{fd}" in cmd
    cmd = cmd.replace("myapp:app", "slowapp:app")
    home = tmp_path / "home"
    home.mkdir()
    with Running(["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0", "--cmd", cmd],
                 env={"HOME": str(home)}, timeout=120) as sup:
        slots = sup.wait_for(lambda st: all(s["state"] == "ready" for s in st["slots"]), timeout=120,
                             what="both gunicorn slots ready")["slots"]
        assert len({s["pid"] for s in slots}) == 2
        assert not (home / ".gunicorn" / "gunicorn.ctl").exists()
        ctl = re.findall(r"Control socket listening at (\S+)", sup.log_tail(400))
        assert len(ctl) == len(set(ctl)), ctl      # never one path for two masters
