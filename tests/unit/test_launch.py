"""numaserve.bind.launch (the exec trampoline) and `numaserve exec`.

Real children are started on this machine: binding, exit codes, one-line
errors, the parent-death signal, restored signal dispositions.  The
trampoline's start-up overhead is measured and printed (``-s`` shows it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from numaserve.bind import launch
from numaserve.bind.launch import LAUNCH_EXIT_BIND_FAILED, LaunchError, build_launch_argv
from numaserve.topology.model import Node, Topology

L = launch.LAUNCHER_PATH
PY = sys.executable
HAVE = os.sched_getaffinity(0)
needs_cpu1 = pytest.mark.skipif(
    not {0, 1} <= HAVE or not os.path.isdir("/sys/devices/system/node/node0"),
    reason="needs CPUs 0-1 and NUMA node 0",
)

# A child that starts 3 threads after exec, then reports every thread's view.
REPORT = r"""
import json, os, threading
ev = threading.Event(); ready = threading.Barrier(4)
def body():
    ready.wait(); ev.wait()
ts = [threading.Thread(target=body) for _ in range(3)]
for t in ts: t.start()
ready.wait()
out = {}
for tid in sorted(os.listdir("/proc/self/task")):
    st = open(f"/proc/self/task/{tid}/status").read()
    cpus = [l.split(":", 1)[1].strip() for l in st.splitlines() if l.startswith("Cpus_allowed_list")][0]
    pols = [l.split()[1] for l in open(f"/proc/self/task/{tid}/numa_maps") if "file=" in l]
    out[tid] = [cpus, max(set(pols), key=pols.count)]
ev.set()
for t in ts: t.join()
print(json.dumps(out))
"""


def run(argv: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)


# --------------------------------------------------------------- argv


def test_build_launch_argv_shape() -> None:
    argv = build_launch_argv(
        ["srv", "--port", "80"], cpus=[3, 2, 2], mempolicy="bind", nodes=[1], ppid=77, python="/py"
    )
    assert argv == [
        "/py", "-I", "-S", L, "--cpus", "2-3", "--mempolicy", "bind", "--nodes", "1",
        "--pdeathsig", "SIGKILL", "--ppid", "77", "--", "srv", "--port", "80",
    ]
    assert build_launch_argv(["x"], cpus=None, mempolicy="local", nodes=[5], pdeathsig=None, python="/py") == [
        "/py", "-I", "-S", L, "--mempolicy", "local", "--", "x",
    ]
    a = build_launch_argv(["x"], cpus=[0], mempolicy="interleave", nodes=[0, 1], static=False, chdir="/srv")
    assert a[a.index("--nodes") + 1] == "0-1" and "--no-static" in a and a[a.index("--chdir") + 1] == "/srv"
    assert a[a.index("--ppid") + 1] == str(os.getpid())  # default: the caller is the parent
    assert "--ppid" not in build_launch_argv(["x"], cpus=None, mempolicy="local", nodes=[], ppid=0)
    assert LAUNCH_EXIT_BIND_FAILED == 126


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(argv=[], mempolicy="bind", nodes=[0]), "empty argv"),
        (dict(argv=["x"], mempolicy="membind", nodes=[0]), "unknown mempolicy"),
        (dict(argv=["x"], mempolicy="bind", nodes=[]), "needs nodes"),
        (dict(argv=["x"], mempolicy="bind", nodes=[0], cpus=[]), "empty cpus"),
        (dict(argv=["x"], mempolicy="bind", nodes=[0], pdeathsig="SIGNOPE"), "unknown signal"),
    ],
)
def test_build_launch_argv_rejects(kw: dict, match: str) -> None:
    kw.setdefault("cpus", None)
    argv = kw.pop("argv")
    with pytest.raises(ValueError, match=match):
        build_launch_argv(argv, **kw)


def test_parse_args_and_signals() -> None:
    o = launch.parse_args(["--cpus=1,3", "--mempolicy", "preferred", "--nodes", "0", "--no-static",
                           "--pdeathsig", "term", "--ppid", "9", "--chdir", "/", "prog", "-x"])
    assert (o.cpus, o.mempolicy, o.nodes, o.static, o.pdeathsig, o.ppid, o.chdir, o.program) == (
        (1, 3), "preferred", (0,), False, signal.SIGTERM, 9, "/", ["prog", "-x"])
    assert launch.parse_args(["--", "--weird-prog"]).program == ["--weird-prog"]
    assert launch.parse_signal("SIGKILL") == launch.parse_signal("KILL") == launch.parse_signal("9") == 9
    assert launch.parse_signal("none") == 0
    for bad, msg in [([], "no PROGRAM"), (["--cpus"], "needs a value"), (["--mempolicy", "bind", "--", "x"], "needs --nodes"),
                     (["--cpus", "a", "--", "x"], "--cpus 'a'"), (["--frob", "x"], "unknown option"),
                     (["--pdeathsig", "SIG_DFL", "x"], "unknown signal")]:
        with pytest.raises(LaunchError, match=msg):
            launch.parse_args(bad)


def test_launcher_file_imports_no_numaserve_and_is_stdlib_only() -> None:
    r = run([PY, "-I", "-S", L, "--mempolicy", "default", "--", PY, "-c", "print('hi')"])
    assert (r.returncode, r.stdout, r.stderr) == (0, "hi\n", "")
    r = run([PY, "-I", "-S", "-X", "importtime", L, "--", "/bin/true"])
    mods = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if "|" in line}
    assert not {m for m in mods if m.startswith("numaserve") or m in ("typing", "dataclasses", "argparse", "enum")}, mods


# -------------------------------------------------------------- binding


@needs_cpu1
def test_launcher_binds_every_thread_of_the_child() -> None:
    r = run(build_launch_argv([PY, "-c", REPORT], cpus=[1], mempolicy="bind", nodes=[0]))
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert len(seen) == 4
    assert set(map(tuple, seen.values())) == {("1", "bind=static:0")}


@needs_cpu1
@pytest.mark.skipif(shutil.which("numactl") is None, reason="numactl not installed")
def test_same_placement_as_numactl_except_static_flag() -> None:
    ours = json.loads(run(build_launch_argv([PY, "-c", REPORT], cpus=[1], mempolicy="bind", nodes=[0])).stdout)
    r = run(["numactl", "--physcpubind=1", "--membind=0", PY, "-c", REPORT])
    assert r.returncode == 0, r.stderr
    theirs = json.loads(r.stdout)
    assert set(map(tuple, theirs.values())) == {("1", "bind:0")}  # numactl never sets MPOL_F_STATIC_NODES
    assert {v[0] for v in ours.values()} == {v[0] for v in theirs.values()}


@needs_cpu1
def test_preferred_interleave_local_and_no_static() -> None:
    for args, token in [
        (["--mempolicy", "preferred", "--nodes", "0"], "prefer=static:0"),
        (["--mempolicy", "interleave", "--nodes", "0"], "interleave=static:0"),
        (["--mempolicy", "local"], "local"),
        (["--mempolicy", "bind", "--nodes", "0", "--no-static"], "bind:0"),
    ]:
        r = run([PY, "-I", "-S", L, *args, "--", PY, "-c", REPORT])
        assert r.returncode == 0, r.stderr
        assert {v[1] for v in json.loads(r.stdout).values()} == {token}, args


@needs_cpu1
def test_without_mempolicy_the_inherited_policy_is_kept() -> None:
    inner = [PY, "-I", "-S", L, "--cpus", "1", "--", PY, "-c", REPORT]
    r = run([PY, "-I", "-S", L, "--mempolicy", "bind", "--nodes", "0", "--no-static", "--", *inner])
    assert r.returncode == 0, r.stderr
    assert set(map(tuple, json.loads(r.stdout).values())) == {("1", "bind:0")}


# ------------------------------------------------------------- failures


@pytest.mark.parametrize(
    "args,code,line",
    [
        (["--mempolicy", "bind", "--nodes", "7", "--", "true"], 126,
         "numaserve-launch: set_mempolicy(bind, nodes=7): Invalid argument — node 7 is not online/allowed"),
        (["--cpus", "4000", "--", "true"], 126, "numaserve-launch: sched_setaffinity(cpus=4000): Invalid argument"),
        (["--", "no-such-program-xyz"], 127, "numaserve-launch: exec no-such-program-xyz: command not found"),
        (["--", "{noexec}"], 126, "numaserve-launch: exec {noexec}: Permission denied"),
        (["--chdir", "/nonexistent-dir", "--", "true"], 126, "numaserve-launch: chdir /nonexistent-dir: No such file"),
        (["--bogus", "--", "true"], 126, "numaserve-launch: usage: unknown option '--bogus'"),
        (["--mempolicy", "bind", "--", "true"], 126, "numaserve-launch: usage: --mempolicy bind needs --nodes"),
    ],
)
def test_failures_are_one_line_and_126_or_127(tmp_path: Path, args: list[str], code: int, line: str) -> None:
    noexec = tmp_path / "data.txt"
    noexec.write_text("not a program\n")
    noexec.chmod(0o644)
    args = [a.format(noexec=noexec) for a in args]
    line = line.format(noexec=noexec)
    r = run([PY, "-I", "-S", L, *args])
    assert r.returncode == code
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(line), r.stderr


def test_signal_dispositions_are_restored_for_the_program() -> None:
    # CPython ignores SIGPIPE/SIGXFSZ at start; ignored dispositions survive exec.
    r = run([PY, "-I", "-S", L, "--", "sh", "-c", "grep SigIgn /proc/self/status"])
    ign = int(r.stdout.split()[1], 16)
    assert not ign & (1 << (signal.SIGPIPE - 1)) and not ign & (1 << (signal.SIGXFSZ - 1)), r.stdout


def _state(pid: int) -> str | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("State:"):
                return line.split()[1]
    except FileNotFoundError:
        return None
    return None


def _wait_dead(pid: int, timeout: float = 15) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _state(pid) in (None, "Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_pdeathsig_child_dies_with_its_parent() -> None:
    # parent (python) -> launcher -> exec sleep; SIGKILL the parent, the sleep must die.
    parent_code = (
        "import os, subprocess, sys\n"
        "from numaserve.bind.launch import build_launch_argv\n"
        "p = subprocess.Popen(build_launch_argv(['sleep', '60'], cpus=None, mempolicy='local', nodes=[]))\n"
        "print(p.pid, flush=True)\n"
        "p.wait()\n"
    )
    parent = subprocess.Popen([PY, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        end = time.monotonic() + 15
        while time.monotonic() < end:  # wait until the launcher exec'd sleep
            try:
                if open(f"/proc/{child}/comm").read().strip() == "sleep":
                    break
            except FileNotFoundError:
                break
            time.sleep(0.05)
        assert _state(child) not in (None, "Z")
        parent.kill()
        parent.wait()
        assert _wait_dead(child), "child outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        if child and _state(child) not in (None, "Z", "X"):
            os.kill(child, signal.SIGKILL)


def test_parent_already_gone_means_no_start() -> None:
    # --ppid names a process that is not our parent: as if the parent had died.
    r = run([PY, "-I", "-S", L, "--pdeathsig", "SIGTERM", "--ppid", "1", "--", "sh", "-c", "echo started"])
    assert r.returncode == -signal.SIGTERM and r.stdout == ""
    r = run([PY, "-I", "-S", L, "--ppid", "1", "--", "sh", "-c", "echo started"])
    assert r.returncode == 126 and r.stdout == ""
    assert r.stderr.startswith("numaserve-launch: parent check: parent 1 is gone")
    r = run([PY, "-I", "-S", L, "--ppid", str(os.getpid()), "--", "sh", "-c", "echo started"])
    assert (r.returncode, r.stdout) == (0, "started\n")


# ------------------------------------------------------------- overhead


def test_trampoline_start_up_overhead() -> None:
    """Median of 20 runs: launcher -> /bin/true vs /bin/true (printed; loose bound)."""

    def median_ms(argv: list[str], n: int = 20) -> float:
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            subprocess.run(argv, check=True)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1000

    true = shutil.which("true") or "/bin/true"
    base = median_ms([true])
    plain = median_ms([PY, "-I", "-S", L, "--", true])
    bound = median_ms([PY, "-I", "-S", L, "--cpus", format(min(HAVE)), "--mempolicy", "bind", "--nodes", "0",
                       "--pdeathsig", "SIGKILL", "--ppid", str(os.getpid()), "--", true])
    bare_py = median_ms([PY, "-I", "-S", "-c", "pass"])
    print(f"\n[trampoline] /bin/true {base:.1f} ms; python -I -S -c pass {bare_py:.1f} ms; "
          f"launch.py -- true {plain:.1f} ms; launch.py bind+pdeathsig -- true {bound:.1f} ms")
    assert bound < 1000


# ------------------------------------------------------------ numaserve exec


def fake_topology() -> Topology:
    return Topology(
        root="/fake",
        nodes=[
            Node(0, (0, 1), (0, 1), 1 << 30, 1 << 29),
            Node(1, (2, 3), (2, 3), 1 << 30, 1 << 29),
            Node(2, (), (), 1 << 30, 1 << 29),                       # memory-only
            Node(3, (4, 5), (), 1 << 30, 1 << 29),                   # cpuset forbids its CPUs
            Node(4, (6,), (6,), None, None, has_memory=False),       # CPU-only
            Node(5, (7,), (7,), None, None, has_memory=False, memory_node=1),  # declared: memory on node 1
        ],
        online_cpus=tuple(range(8)),
        allowed_cpus=(0, 1, 2, 3, 6, 7),
        allowed_mems=(0, 1, 2),
    )


def run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str]) -> tuple[int, str, str]:
    from numaserve.cli import exec_cmd, main

    monkeypatch.setattr(exec_cmd, "_discover", lambda root, declared: fake_topology())
    with pytest.raises(SystemExit) as ei:
        main(["exec", *args])
    out, err = capsys.readouterr()
    return int(ei.value.code or 0), out, err


@pytest.mark.parametrize(
    "args,line",
    [
        (["--node", "9", "--", "true"], "numaserve: error: exec: no NUMA node 9 (usable nodes: 0-1,4-5)"),
        (["--node", "1", "--cpus", "1-2", "--", "true"],
         "numaserve: error: exec: --cpus 1 not usable on node 1 (usable CPUs: 2-3)"),
        (["--node", "1", "--cpus", "x", "--", "true"], "numaserve: error: exec: --cpus: bad element"),
        (["--node", "2", "--", "true"], "numaserve: error: exec: node 2 has no CPUs (usable nodes: 0-1,4-5)"),
        (["--node", "3", "--", "true"], "numaserve: error: exec: node 3 has no CPU this process may use"),
        (["--node", "4", "--", "true"], "numaserve: error: exec: node 4 has no memory; use --mempolicy local"),
        (["--node", "0", "--mem-nodes", "5", "--", "true"], "numaserve: error: exec: --mem-nodes 5 not allowed"),
        (["--node", "0"], "numaserve: error: exec: no command given"),
        (["--node", "0", "--"], "numaserve: error: exec: no command given"),
    ],
)
def test_exec_usage_errors_exit_2(monkeypatch, capsys, args: list[str], line: str) -> None:
    code, out, err = run_cli(monkeypatch, capsys, args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(line), err


@pytest.mark.parametrize(
    "args,expect",
    [
        (["--node", "1"], "cpus=2-3 mempolicy=bind nodes=1 static=True"),
        (["--node", "1", "--cpus", "3", "--mempolicy", "preferred"], "cpus=3 mempolicy=preferred nodes=1 static=True"),
        (["--node", "4", "--mempolicy", "local"], "cpus=6 mempolicy=local nodes=- static=True"),
        (["--node", "5"], "cpus=7 mempolicy=bind nodes=1 static=True"),   # declared memory node
        (["--node", "0", "--mempolicy", "interleave", "--mem-nodes", "0-1", "--no-static"],
         "cpus=0-1 mempolicy=interleave nodes=0-1 static=False"),
    ],
)
def test_exec_resolves_cpus_and_memory_node(monkeypatch, capsys, args: list[str], expect: str) -> None:
    code, out, err = run_cli(monkeypatch, capsys, [*args, "--dry-run", "--", "prog", "--flag"])
    assert (code, err) == (0, "")
    assert out.startswith(expect) and out.rstrip().endswith("command=['prog', '--flag']")


def _have_discover() -> bool:
    try:
        from numaserve.topology import discover  # noqa: F401
    except ImportError:
        return False
    return True


@needs_cpu1
@pytest.mark.skipif(not _have_discover(), reason="numaserve.topology.discover not available yet")
def test_exec_for_real_binds_and_execs() -> None:
    r = run([PY, "-m", "numaserve", "exec", "--node", "0", "--cpus", "1", "--", PY, "-c", REPORT])
    assert r.returncode == 0, r.stderr
    assert set(map(tuple, json.loads(r.stdout).values())) == {("1", "bind=static:0")}
    r = run([PY, "-m", "numaserve", "exec", "--node", "5", "--", "true"])
    assert r.returncode == 2 and "no NUMA node 5 (usable nodes: 0)" in r.stderr, r.stderr
    r = run([PY, "-m", "numaserve", "exec", "--node", "0", "--", "no-such-program-xyz"])
    assert r.returncode == 127 and r.stderr.strip() == "numaserve: error: exec no-such-program-xyz: command not found"
