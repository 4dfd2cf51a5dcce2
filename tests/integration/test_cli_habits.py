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

pytestmark = pytest.mark.slow   # a real supervisor with two workers

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


def test_ratelimit_show_says_which_override_holds_which_slot_and_auto_says_what_it_did(sup: Running) -> None:
    r = sup.ops("ratelimit", "set", "--slot", "1", "2")
    assert r.returncode == 0 and "applied by 2/2 workers" in r.stdout, (r.stdout, r.stderr)
    r = sup.ops("ratelimit", "show")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "mode auto, operator override on slot 1 (until `numaserve ratelimit auto`)", r.stdout
    head = lines[1].split()
    rows = {int(x.split()[0]): x for x in lines[2:]}
    assert "override" not in rows[0] and "slot 1" not in rows[0], r.stdout      # slot 0 is not overridden
    assert rows[1].rstrip().endswith("operator — operator override for slot 1"), r.stdout
    for row in rows.values():   # just acknowledged by both workers: applied, not an old epoch
        assert row.split()[head.index("APPLIED")] == "yes", r.stdout
    r = sup.ops("ratelimit", "auto")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("auto on every slot: operator overrides cleared") and "applied by 2/2 workers" \
        in r.stdout, r.stdout
    r = sup.ops("ratelimit", "show")
    assert r.stdout.splitlines()[0] == "mode auto", r.stdout


def test_a_drained_slot_has_no_age(sup: Running) -> None:
    r = sup.ops("drain", "--slot", "1", "--wait", timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    try:
        r = sup.ops("status")
        lines = r.stdout.splitlines()
        header = next(x.split() for x in lines if x.split()[:2] == ["slot", "node"])
        row = next(x.split() for x in lines if x.split()[:1] == ["1"] and "drained" in x)
        assert row[header.index("up")] == "-", r.stdout
    finally:
        assert sup.ops("undrain", "--wait", timeout=120).returncode == 0
