"""`numaserve plan` and `numaserve config check|show`: output contracts and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import numaserve.topology
from numaserve.cli import main
from numaserve.config import Config
from numaserve.topology.model import Gpu, Nic, Node, Topology
from tests import hwloc_dumps

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config" / "numaserve.toml"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("NUMASERVE_"):
            monkeypatch.delenv(name)


@pytest.fixture
def empty_config(tmp_path: Path) -> Path:
    """An explicit empty config, so a host /etc/numaserve/numaserve.toml never leaks in."""
    p = tmp_path / "empty.toml"
    p.write_text("")
    return p


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    code = e.value.code
    return (code if isinstance(code, int) else 1), out, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("numaserve: error: "), err
    assert "Traceback" not in err
    for f in fragments:
        assert f in lines[0], err


# --- a hand-built machine behind discover() ---------------------------------------------


def machine() -> Topology:
    """2 nodes x 4 cores x 2 threads, a NIC and 2 GPUs on node 0, memory-only node 250."""
    smt = {}
    for c in range(8):
        smt[c] = smt[c + 8] = (c, c + 8)
    n0 = Node(0, (0, 1, 2, 3, 8, 9, 10, 11), (0, 1, 2, 3, 8, 9, 10, 11), 1 << 30, 1 << 29)
    n1 = Node(1, (4, 5, 6, 7, 12, 13, 14, 15), (4, 5, 6, 7, 12, 13, 14, 15), 1 << 30, 1 << 29)
    n250 = Node(250, (), (), 1 << 34, 1 << 34)
    return Topology(
        root="/fake",
        nodes=[n0, n1, n250],
        online_cpus=tuple(range(16)),
        allowed_cpus=tuple(range(16)),
        allowed_mems=(0, 1, 250),
        smt_siblings=smt,
        nics=[Nic("eth0", "mlx5_core", "0000:17:00.0", 0, "sysfs", tuple(range(16)), 8, 8)],
        gpus=[Gpu(f"0000:{b}:00.0", "0x10de", "0x20b0", "0x030200", "nvidia", 0) for b in ("3b", "3c")],
    )


@pytest.fixture
def fake_discover(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []

    def discover(root: str = "/", *, declared: str | None = None, nic_nodes: Any = None) -> Topology:
        calls.append({"root": root, "declared": declared})
        topo = machine()
        topo.root, topo.declared = root, declared
        return topo

    monkeypatch.setattr(numaserve.topology, "discover", discover, raising=False)
    yield calls


# --- plan ---------------------------------------------------------------------------------


def test_plan_json_contract(capsys: pytest.CaptureFixture[str], empty_config: Path, fake_discover: list[dict[str, Any]]) -> None:
    code, out, err = run(["plan", "--config", str(empty_config), "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert [(s["slot"], s["node"], s["cpus"], s["mempolicy"], s["gpus"]) for s in data["slots"]] == [
        (0, 0, [0, 1, 2, 3, 8, 9, 10, 11], "bind", ["0000:3b:00.0", "0000:3c:00.0"]),
        (1, 1, [4, 5, 6, 7, 12, 13, 14, 15], "bind", []),
    ]
    assert data["slots"][0]["memory_nodes"] == [0] and data["slots"][1]["listener"] == 1
    assert data["skipped"] == [{"node": 250, "reason": "no CPUs (memory-only node)"}]
    assert fake_discover == [{"root": "/", "declared": None}]


def test_plan_is_a_table_when_piped_and_json_when_asked(capsys: pytest.CaptureFixture[str], empty_config: Path,
                                                        fake_discover: list[dict[str, Any]]) -> None:
    code, out, _ = run(["plan", "--config", str(empty_config)], capsys)  # capsys stdout is not a tty
    assert code == 0 and not out.lstrip().startswith("{") and "slot" in out.lower(), out
    for flag in (["--json"], ["-o", "json"], ["--output", "JSON"]):
        code, out, _ = run(["plan", "--config", str(empty_config), *flag], capsys)
        assert code == 0 and json.loads(out)["slots"]


def test_plan_flags_override_config(tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_discover: list[dict[str, Any]]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        "[placement]\nnodes = '1'\nworkers_per_node = 4\nreserve_irq_cpus = 1\n"
        "sysfs_root = '/from/config'\ntopology_file = '/etc/topo.toml'\n"
    )
    code, out, err = run(["plan", "--config", str(cfg), "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert {s["node"] for s in data["slots"]} == {1} and len(data["slots"]) == 4
    assert fake_discover[-1] == {"root": "/from/config", "declared": "/etc/topo.toml"}

    code, out, err = run(
        ["plan", "--config", str(cfg), "--json", "--nodes", "0", "--workers-per-node", "auto",
         "--root", "/flag/root", "--declared", "/flag/topo.toml"],
        capsys,
    )
    assert code == 0, err
    data = json.loads(out)
    # auto on node 0 = its 2 GPUs; the NIC's IRQ core (3, 11) is kept away from workers
    assert [s["cpus"] for s in data["slots"]] == [[0, 1, 8, 9], [2, 10]]
    assert [s["gpus"] for s in data["slots"]] == [["0000:3b:00.0"], ["0000:3c:00.0"]]
    assert data["irq_cpus"] == {"0": [3, 11]}
    assert fake_discover[-1] == {"root": "/flag/root", "declared": "/flag/topo.toml"}


def test_plan_table(capsys: pytest.CaptureFixture[str], empty_config: Path, fake_discover: list[dict[str, Any]]) -> None:
    code, out, err = run(
        ["plan", "--config", str(empty_config), "--no-json", "--workers-per-node", "2"], capsys
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("4 slot(s) on node(s) 0,1 (workers_per_node=2")
    assert lines[2].split() == ["SLOT", "NODE", "IDX", "CPUS", "MEMORY", "GPUS"]
    assert lines[3].split() == ["0", "0", "0", "0-1,8-9", "bind:0", "0000:3b:00.0"]
    assert lines[6].split() == ["3", "1", "1", "6-7,14-15", "bind:1", "-"]
    assert "skipped:" in lines and "  node 250: no CPUs (memory-only node)" in lines
    assert "\x1b[" not in out


def test_plan_table_shows_interleave_and_notes(capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_discover: list[dict[str, Any]]) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[placement]\nmempolicy = 'interleave'\nworkers_per_node = 12\n")
    code, out, err = run(["plan", "--config", str(cfg), "--no-json", "--nodes", "1"], capsys)
    assert code == 0, err
    assert "interleave:1" in out
    assert "notes:" in out and "12 workers > 8 usable CPUs" in out


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["--nodes", "x"], ["flag --nodes", 'placement.nodes = "x"', '"all" or a node list']),
        (["--nodes", "3-1"], ["flag --nodes", "descending range"]),
        (["--nodes", "5"], ["node 5 does not exist; nodes on this machine: 0,1,250; usable: 0,1"]),
        (["--nodes", "250"], ["node 250 cannot be used: no CPUs (memory-only node); usable nodes: 0,1"]),
        (["--workers-per-node", "0"], ["flag --workers-per-node", "workers_per_node = 0", 'an integer >= 1 or "auto"']),
        (["--workers-per-node", "-1"], ["flag --workers-per-node", "workers_per_node = -1"]),
        (["--workers-per-node", "x"], ["flag --workers-per-node", 'workers_per_node = "x"']),
        (["--workers-per-node", "1.5"], ["flag --workers-per-node", 'workers_per_node = "1.5"']),
    ],
)
def test_plan_bad_arguments_are_one_line_exit_2(
    args: list[str], fragments: list[str], capsys: pytest.CaptureFixture[str], empty_config: Path,
    fake_discover: list[dict[str, Any]],
) -> None:
    code, out, err = run(["plan", "--config", str(empty_config), *args], capsys)
    assert out == ""
    assert_one_line_error(code, err, *fragments)


def test_plan_bad_config_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_discover: list[dict[str, Any]]) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[placement]\ncpu_split = 'even'\n")
    code, _, err = run(["plan", "--config", str(cfg)], capsys)
    assert_one_line_error(code, err, str(cfg), 'placement.cpu_split = "even"', 'one of "split", "shared"')
    assert fake_discover == []  # config is checked before touching the machine


def test_plan_config_from_environment(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], empty_config: Path, fake_discover: list[dict[str, Any]]) -> None:
    monkeypatch.setenv("NUMASERVE_PLACEMENT_MEMPOLICY", "preferred")
    monkeypatch.setenv("NUMASERVE_CONFIG", str(empty_config))
    code, out, err = run(["plan", "--json"], capsys)
    assert code == 0, err
    assert {s["mempolicy"] for s in json.loads(out)["slots"]} == {"preferred"}


# --- config check / show ---------------------------------------------------------------


def test_config_check_example_ok(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["config", "check", str(EXAMPLE)], capsys)
    assert (code, out, err) == (0, f"{EXAMPLE}: ok\n", "")


@pytest.mark.parametrize(
    "text,fragments",
    [
        ("[server]\nbacklog = 'x'\n", ['server.backlog = "x"', "expected an integer"]),
        ("[nope]\n", ["unknown section [nope]"]),
        ("[server\n", ["invalid TOML"]),
        (b"\xff\xfe", ["not UTF-8"]),
    ],
)
def test_config_check_errors(text: str | bytes, fragments: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "c.toml"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    code, out, err = run(["config", "check", str(p)], capsys)
    assert out == ""
    assert_one_line_error(code, err, str(p), *fragments)


def test_config_check_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(["config", "check", str(tmp_path / "missing.toml")], capsys)
    assert_one_line_error(code, err, "missing.toml: config file not found")


def test_config_check_includes_environment(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("NUMASERVE_SERVER_BACKLOG", "-3")
    code, _, err = run(["config", "check", str(EXAMPLE)], capsys)
    assert_one_line_error(code, err, "environment NUMASERVE_SERVER_BACKLOG", "server.backlog = -3")


def test_config_show_json_is_merged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[server]\nbacklog = 100\nbind = [':9000']\n")
    monkeypatch.setenv("NUMASERVE_PLACEMENT_WORKERS_PER_NODE", "auto")
    code, out, err = run(["--log-level", "debug", "config", "show", "--config", str(p), "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["server"]["backlog"] == 100 and data["server"]["bind"] == [":9000"]
    assert data["placement"]["workers_per_node"] == "auto"
    assert data["log"]["level"] == "debug"
    assert data["supervisor"] == Config().to_dict()["supervisor"]


def test_config_show_toml(empty_config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["config", "show", "--config", str(empty_config), "--no-json"], capsys)
    assert code == 0, err
    assert tomllib.loads(out) == Config().to_dict()


def test_config_show_is_toml_when_piped_and_json_when_asked(empty_config: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["config", "show", "--config", str(empty_config)], capsys)
    assert code == 0 and tomllib.loads(out) == Config().to_dict()
    code, out, _ = run(["config", "show", "--config", str(empty_config), "--json"], capsys)
    assert code == 0 and json.loads(out) == Config().to_dict()
    code, _, err = run(["config", "show", "--config", str(empty_config), "--json", "-o", "table"], capsys)
    assert code == 2 and "disagree" in err


def test_config_show_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[log]\nformat = 'xml'\n")
    code, _, err = run(["config", "show", "--config", str(p)], capsys)
    assert_one_line_error(code, err, 'log.format = "xml"')


# --- real processes: no traceback, exit status -------------------------------------------


def _numaserve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("NUMASERVE_")}
    return subprocess.run(
        [sys.executable, "-m", "numaserve", *args], capture_output=True, text=True, timeout=60,
        env={**base, **(env or {})}, cwd=REPO,
    )


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--nodes", "x"],
        ["plan", "--workers-per-node", "0"],
        ["plan", "--workers-per-node", "-1"],
        ["plan", "--workers-per-node", "x"],
        ["config", "check", "/nonexistent/numaserve.toml"],
    ],
)
def test_subprocess_errors_exit_2_without_traceback(args: list[str], empty_config: Path) -> None:
    if args[0] == "plan":
        args = [*args, "--config", str(empty_config)]
    r = _numaserve(*args)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("numaserve: error: "), r.stderr


def test_subprocess_bad_config_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("[placement]\nmempolicy = 'hard'\n")
    r = _numaserve("plan", "--config", str(p))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == (
        f'numaserve: error: {p}: placement.mempolicy = "hard": '
        'expected one of "bind", "preferred", "interleave", "local"'
    )


# --- end to end with the real discovery ----------------------------------------------------


def _discover_available() -> bool:
    try:
        from numaserve.topology import discover  # noqa: F401
    except ImportError:
        return False
    return True


needs_discover = pytest.mark.skipif(not _discover_available(), reason="numaserve.topology.discover not available")


@needs_discover
def test_plan_this_machine(empty_config: Path) -> None:
    r = _numaserve("plan", "--config", str(empty_config), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["slots"] and data["root"] == "/"
    allowed = os.sched_getaffinity(0)
    for s in data["slots"]:
        assert set(s["cpus"]) <= allowed
        assert s["memory_nodes"] == [s["node"]]


@needs_discover
def test_plan_declared_pretend_nodes_on_this_machine(tmp_path: Path, empty_config: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 or not Path("/sys/devices/system/node/node0").is_dir():
        pytest.skip("needs 2 usable CPUs and a node 0")
    topo = tmp_path / "topology.toml"
    topo.write_text(
        f'mode = "replace"\n[[node]]\nid = 0\ncpus = "{cpus[0]}"\nmemory_node = 0\n'
        f'[[node]]\nid = 1\ncpus = "{cpus[1]}"\nmemory_node = 0\n'
    )
    r = _numaserve("plan", "--config", str(empty_config), "--declared", str(topo), "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [(s["node"], s["cpus"], s["memory_nodes"]) for s in data["slots"]] == [
        (0, [cpus[0]], [0]), (1, [cpus[1]], [0]),
    ]
    assert data["declared"] == str(topo)


@needs_discover
@pytest.mark.fixtures
@pytest.mark.parametrize(
    "fixture,expect_nodes,expect_skipped",
    [
        ("nvidiagpunumanodes", [0], [8, 250, 251, 252, 253, 254, 255]),
        ("48amd64-4pa2n6c-sparse", [0, 1, 2, 33, 34, 45, 72, 73], []),
        ("32intel64-2p8co2t+8ve", [0, 1], []),
    ],
)
def test_plan_hwloc_fixtures(
    fixture: str, expect_nodes: list[int], expect_skipped: list[int],
    capsys: pytest.CaptureFixture[str], empty_config: Path,
) -> None:
    root = hwloc_dumps.extracted(fixture)
    code, out, err = run(["plan", "--config", str(empty_config), "--root", str(root), "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert [s["node"] for s in data["slots"]] == expect_nodes
    assert [s["node"] for s in data["skipped"]] == expect_skipped
    memory_only = [s for s in data["skipped"] if s["node"] >= 250]
    assert all(s["reason"] == "no CPUs (memory-only node)" for s in memory_only)
    if fixture.startswith("32intel64"):
        code, out, _ = run(
            ["plan", "--config", str(empty_config), "--root", str(root), "--json", "--workers-per-node", "2"],
            capsys,
        )
        # SMT siblings (c, c+16) stay in one slot
        assert [s["cpus"] for s in json.loads(out)["slots"]][:2] == [
            [0, 1, 2, 3, 16, 17, 18, 19], [4, 5, 6, 7, 20, 21, 22, 23],
        ]
