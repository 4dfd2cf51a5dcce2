"""`numaserve profile`: py-spy against a live worker, and its error messages.

The first tests are pure (no processes); the ones marked slow start a real
supervisor and attach py-spy to its worker (they skip, saying why, when
py-spy is missing or this user may not ptrace the worker).
"""

from __future__ import annotations

import json
import threading
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Iterator

import pytest

from numaserve.tools import profiling
from numaserve.errors import NumaserveError, UsageError
from numaserve.tools.profiling import (
    INSTALL_HINT,
    default_output,
    explain_failure,
    ptrace_denial,
    py_spy_argv,
    slot_worker_pid,
)
from tests.integration.test_loadtest_cli import ns

# ------------------------------------------------------------------- pure


@pytest.mark.parametrize("euid, cap, scope, tuid, expect", [
    (0, True, 1, 0, None),                       # root with the capability: fine at scope 1
    (1000, False, 0, 1000, None),                # same user, classic scope
    (1000, False, None, 1000, None),             # no Yama at all
    (1000, False, 1, 1000, "kernel.yama.ptrace_scope = 1"),
    (1000, False, 2, 1000, "kernel.yama.ptrace_scope = 2"),
    (0, True, 3, 0, "kernel.yama.ptrace_scope = 3"),
    (1000, False, 0, 0, "runs as uid 0, you are uid 1000"),
])
def test_ptrace_denial(euid: int, cap: bool, scope: int | None, tuid: int, expect: str | None) -> None:
    why = ptrace_denial(42, euid=euid, cap=cap, scope=scope, target_uid=tuid)
    if expect is None:
        assert why is None
    else:
        assert why is not None and expect in why and "pid 42" in why and "\n" not in why
        if scope in (1, 2) or tuid != euid:
            assert "CAP_SYS_PTRACE" in why


def test_explain_failure() -> None:
    perm = explain_failure("Permission Denied: Try running again with elevated permissions", 7, 1)
    assert "permission" in perm.lower() and "CAP_SYS_PTRACE" in perm
    assert "--idle" in explain_failure("[x ERROR inferno] No stack counts found\nError: Failed to write flamegraph: "
                                       "No stack counts found", 7, 1)
    assert "gone" in explain_failure("Error: Failed to get process executable name. Check that the process is "
                                     "running.\n\nCaused by:\n    0: No such file", 7, 1)
    other = explain_failure("py-spy> Sampling\nError: Failed to find python version from target process\n", 7, 1)
    assert other == "py-spy failed (exit 1): Error: Failed to find python version from target process"
    assert explain_failure("something odd\nlast words", 7, 3) == "py-spy failed (exit 3): last words"


def test_argv_output_and_slot_lookup() -> None:
    argv = py_spy_argv("/bin/py-spy", 12, duration=2, fmt="speedscope", output=Path("o.json"), rate=250,
                       native=True, nonblocking=True)
    assert argv == ["/bin/py-spy", "record", "--pid", "12", "--duration", "2", "--rate", "250", "--format",
                    "speedscope", "--output", "o.json", "--native", "--nonblocking"]
    assert default_output(3, 99, "flamegraph", 0).name.startswith("numaserve-slot3-pid99-")
    assert default_output(3, 99, "raw", 0).suffix == ".txt"
    status = {"slots": [{"slot": 0, "pid": 11, "state": "ready"}, {"slot": 1, "pid": None, "state": "drained"}]}
    assert slot_worker_pid(status, 0) == 11
    with pytest.raises(NumaserveError, match="slot 1 has no worker \\(state drained\\)") as ei:
        slot_worker_pid(status, 1)
    assert ei.value.exit_code == 1
    with pytest.raises(UsageError, match="no slot 5 \\(slots: 0, 1\\)"):
        slot_worker_pid(status, 5)


def test_missing_py_spy_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(profiling, "find_py_spy", lambda: None)
    with pytest.raises(NumaserveError) as ei:
        profiling.record(1, duration=1, fmt="raw", output=tmp_path / "x.txt")
    assert str(ei.value) == INSTALL_HINT and ei.value.exit_code == 1
    assert "pip install 'numaserve[profile]'" in INSTALL_HINT


def test_cli_usage_and_unreachable_supervisor(tmp_path: Path) -> None:
    r = ns("profile", "--runtime-dir", str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--slot" in r.stderr
    r = ns("profile", "--runtime-dir", str(tmp_path), "--slot", "0", "--format", "png")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    r = ns("profile", "--runtime-dir", str(tmp_path), "--slot", "0")
    assert r.returncode == 1 and r.stderr.startswith("numaserve: error:") and r.stderr.count("\n") == 1
    r = ns("profile", "--endpoint", "tcp://127.0.0.1:9", "--slot", "0")
    assert r.returncode == 2 and "without --endpoint" in r.stderr


# ------------------------------------------------------------------- live


@pytest.fixture(scope="module")
def loaded() -> Iterator[Any]:
    """A supervisor with two demo workers, kept busy with completions while tests run."""
    from numaserve.tools.loadtest import LoadConfig, run_load
    from tests.integration.harness import Running

    with Running(["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0"]) as sup:
        pid = sup.slots()[0]["pid"]
        if profiling.find_py_spy() is None:
            pytest.skip("py-spy is not installed (pip install 'numaserve[profile]')")
        why = ptrace_denial(pid)
        if why:
            pytest.skip(f"py-spy cannot attach here: {why}")
        stop = threading.Event()

        def load() -> None:
            body = json.dumps({"prompt": "profile me", "max_tokens": 16}).encode()
            while not stop.is_set():   # each round is bounded; the loop ends with the fixture
                run_load(LoadConfig(f"http://127.0.0.1:{sup.port}/v1/completions", rate=60, duration=1.0,
                                    method="POST", body=body, keepalive=False))

        t = threading.Thread(target=load, daemon=True)
        t.start()
        try:
            yield sup
        finally:
            stop.set()
            t.join(15)


@pytest.mark.slow
def test_speedscope_profile_has_samples_of_the_demo(loaded: Any, tmp_path: Path) -> None:
    out = tmp_path / "slot0.json"
    r = ns("profile", "--runtime-dir", str(loaded.rt), "--slot", "0", "--duration", "2", "--format",
           "speedscope", "--output", str(out), "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    meta = json.loads(r.stdout)
    assert meta["slot"] == 0 and meta["pid"] == loaded.slots()[0]["pid"] and meta["output"] == str(out)
    doc = json.loads(out.read_text())
    samples = sum(len(p["samples"]) for p in doc["profiles"])
    assert samples > 0 and meta["samples"] == samples
    names = {f["name"] for f in doc["shared"]["frames"]}
    assert "_mix" in names or "generate" in names, sorted(names)[:40]   # the demo's hot loop


@pytest.mark.slow
def test_flamegraph_svg_parses_and_raw_has_stacks(loaded: Any, tmp_path: Path) -> None:
    svg = tmp_path / "flame.svg"
    r = ns("profile", "--runtime-dir", str(loaded.rt), "--slot", "1", "--duration", "2", "--output", str(svg),
           "--no-json", timeout=60)
    assert r.returncode == 0, r.stderr
    assert str(svg) in r.stdout and "samples" in r.stdout
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    r = ns("profile", "--runtime-dir", str(loaded.rt), "--slot", "0", "--duration", "1", "--format", "raw",
           "--output", str(tmp_path), "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    raw = Path(json.loads(r.stdout)["output"])
    assert raw.parent == tmp_path and raw.suffix == ".txt"
    lines = raw.read_text().splitlines()
    assert lines and all(ln.rsplit(" ", 1)[1].isdigit() for ln in lines)


@pytest.mark.slow
def test_no_slot_and_drained_slot(loaded: Any) -> None:
    r = ns("profile", "--runtime-dir", str(loaded.rt), "--slot", "9", "--duration", "1")
    assert r.returncode == 2 and "no slot 9 (slots: 0, 1)" in r.stderr
    d = loaded.ops("drain", "--slot", "1", "--wait", "--json", "--drain-timeout", "5", timeout=60)
    assert d.returncode == 0, d.stderr
    try:
        r = ns("profile", "--runtime-dir", str(loaded.rt), "--slot", "1", "--duration", "1")
        assert r.returncode == 1 and "slot 1 has no worker (state drained)" in r.stderr, r.stderr
    finally:
        u = loaded.ops("undrain", "--slot", "1", "--wait", "--json", timeout=60)
        assert u.returncode == 0, u.stderr
