"""The ops CLI as an operator coming from kubectl/systemctl uses it, against a real supervisor.

Tables unless JSON is asked for (whether stdout is a terminal or a pipe),
progress of ``--wait`` on stderr, and the ``ratelimit``/``status``/``top``
details of issue 35.  Every command goes through the real console script.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.integration.harness import Running

TWO = ["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0"]


@pytest.fixture(scope="module")
def sup() -> Iterator[Running]:
    with Running(TWO) as s:
        yield s


def test_status_is_a_table_when_piped_and_json_when_asked(sup: Running) -> None:
    r = sup.ops("status")              # stdout is a pipe here, as under `watch` or `| grep`
    assert r.returncode == 0, r.stderr
    assert not r.stdout.lstrip().startswith("{"), r.stdout[:300]
    assert "supervisor pid" in r.stdout, r.stdout
    assert any(line.split()[:2] == ["slot", "node"] and "state" in line for line in r.stdout.splitlines()), r.stdout
    for flag in (["--json"], ["-o", "json"], ["--output=json"]):
        r = sup.ops("status", *flag)
        assert r.returncode == 0, r.stderr
        assert len(json.loads(r.stdout)["slots"]) == 2


def test_wait_progress_goes_to_stderr_and_the_outcome_to_stdout(sup: Running) -> None:
    r = sup.ops("reload", "--wait", timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "(reload) started" in r.stderr and "+" in r.stderr, r.stderr
    assert "succeeded" in r.stdout and "started" not in r.stdout, r.stdout
    r = sup.ops("reload", "--wait", "--json", timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert json.loads(r.stdout)["state"] == "succeeded"
    assert "(reload) started" in r.stderr and "  +" in r.stderr, r.stderr
