"""`numaserve topology`: JSON contract, tables, config defaults, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from numaserve.cli import cli
from numaserve.errors import UsageError

STATIC = "2node-nics"


@pytest.fixture
def run(tmp_path):
    """Invoke the CLI in-process with an empty config file (no /etc/numaserve leaks in)."""
    empty = tmp_path / "empty.toml"
    empty.write_text("")

    def invoke(*args: str, config: str | None = None):
        env = {"NUMASERVE_CONFIG": config or str(empty)}
        return CliRunner().invoke(cli, ["topology", *args], env=env, catch_exceptions=False)

    return invoke


def run_subprocess(*args: str, tmp_path):
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    return subprocess.run(
        [sys.executable, "-m", "numaserve", "topology", *args],
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "NUMASERVE_CONFIG": str(empty)},
    )


def check_contract(j):
    for key in ("root", "declared", "online_cpus", "allowed_cpus", "allowed_mems", "nodes", "nics", "gpus",
                "system", "unknowns"):
        assert key in j
    for n in j["nodes"]:
        assert isinstance(n["id"], int)
        assert all(isinstance(c, int) for c in n["cpus"])
        assert "memory_total_bytes" in n
        assert set(n["distances"]) == {str(m["id"]) for m in j["nodes"]}
        assert n["distances"][str(n["id"])] == 10
    for x in j["nics"]:
        assert {"name", "numa_node", "irqs"} <= set(x)
        for i in x["irqs"]:
            assert {"irq", "name", "affinity"} <= set(i)
    for g in j["gpus"]:
        assert {"pci", "numa_node"} <= set(g)


def test_json_on_static_tree(run, static_tree):
    r = run("--json", "--root", str(static_tree(STATIC)))
    assert r.exit_code == 0, r.output
    j = json.loads(r.output)
    check_contract(j)
    assert [n["cpus"] for n in j["nodes"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert {x["name"]: x["numa_node"] for x in j["nics"]} == {
        "ens1f0": 0, "ens2": 0, "ens3": None, "eth0": 1, "eth1": None,
    }
    assert j["system"]["irqbalance_running"] is True


def test_not_a_tty_is_still_a_table_and_json_is_asked_for(run, static_tree):
    r = run("--root", str(static_tree(STATIC)))
    assert r.exit_code == 0 and "NUMA nodes" in r.output
    r = run("--json", "--root", str(static_tree(STATIC)))
    assert r.exit_code == 0
    assert json.loads(r.output)["root"].endswith(STATIC)


def test_tables_with_no_json(run, static_tree):
    r = run("--no-json", "--root", str(static_tree(STATIC)))
    assert r.exit_code == 0
    for text in ("NUMA nodes", "Distances", "NICs", "mlx5_core", "GPUs", "irqbalance", "Unknown", "madvise"):
        assert text in r.output


@pytest.mark.fixtures
def test_json_on_hwloc_fixture(run, hwloc_root):
    r = run("--json", "--root", str(hwloc_root("48amd64-4pa2n6c-sparse")))
    j = json.loads(r.output)
    check_contract(j)
    assert [n["id"] for n in j["nodes"]] == [0, 1, 2, 33, 34, 45, 72, 73]
    assert j["nodes"][3]["distances"]["33"] == 10


def test_declared_flag(run, tmp_path, static_tree):
    decl = tmp_path / "t.toml"
    decl.write_text('[[node]]\nid = 0\ncpus = "0-7"\n')
    r = run("--json", "--root", str(static_tree(STATIC)), "--declared", str(decl))
    j = json.loads(r.output)
    assert j["declared"] == str(decl) and [n["id"] for n in j["nodes"]] == [0]


def test_config_supplies_root_and_declared(run, tmp_path, static_tree):
    decl = tmp_path / "t.toml"
    decl.write_text('[[node]]\nid = 3\ncpus = "4-7"\nmemory_node = 1\n')
    cfg = tmp_path / "numaserve.toml"
    cfg.write_text(f'[placement]\nsysfs_root = "{static_tree(STATIC)}"\ntopology_file = "{decl}"\n')
    j = json.loads(run("--json", config=str(cfg)).output)
    assert [n["id"] for n in j["nodes"]] == [3] and j["nodes"][0]["memory_node"] == 1
    # flags win over the config
    other = tmp_path / "other.toml"
    other.write_text('[[node]]\nid = 7\ncpus = "0-3"\nmemory_node = 0\n')
    j = json.loads(run("--json", "--declared", str(other), config=str(cfg)).output)
    assert [n["id"] for n in j["nodes"]] == [7]
    with pytest.raises(UsageError, match="absent: no such directory"):
        run("--json", "--root", str(tmp_path / "absent"), config=str(cfg))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--root", "/nonexistent/numaserve-root"], "no such directory"),
        (["--root", "/proc/self/fd"], "no sys/devices/system"),
    ],
)
def test_bad_root_exit_2_one_line(tmp_path, args, message):
    p = run_subprocess("--json", *args, tmp_path=tmp_path)
    assert p.returncode == 2
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("numaserve: error:")
    assert "Traceback" not in p.stderr


def test_bad_declared_exit_2_one_line(tmp_path, static_tree):
    decl = tmp_path / "bad.toml"
    decl.write_text('mode = "sideways"\n')
    p = run_subprocess("--root", str(static_tree(STATIC)), "--declared", str(decl), tmp_path=tmp_path)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and str(decl) in lines[0] and "mode" in lines[0] and "sideways" in lines[0]
    assert "Traceback" not in p.stderr
