"""numaserve.bind.verify: numa_maps parsing, hand-made /proc trees, real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from numaserve.bind import launch, verify
from numaserve.bind.verify import ObservedPlacement, ThreadPlacement, check_placement, parse_numa_maps, read_placement

SAMPLE = """\
55dca7ce3000 bind=static:1 file=/usr/bin/python3.11 mapped=1 N1=1 kernelpagesize_kB=4
55dca7ce4000 bind=static:1 file=/opt/my\\040app/lib.so mapped=10 mapmax=2 N0=4 N1=6 kernelpagesize_kB=4
55dca8000000 bind=static:1 heap anon=300 dirty=300 N1=300 kernelpagesize_kB=4
7f0000000000 interleave:0-1 anon=100 dirty=100 N0=50 N1=50 kernelpagesize_kB=4
7f1000000000 prefer (many)=static:0-1 anon=2 dirty=2 N0=2 kernelpagesize_kB=4
7f2000000000 weighted interleave:0-1 anon=2 dirty=2 N1=2 kernelpagesize_kB=4
7f3000000000 default file=/dev/shm/seg huge dirty=2 N0=2 kernelpagesize_kB=2048
7f4000000000 default file=/dev/zero
7f5000000000 bind=static:1
7f6000000000 bind=static:1
7fff702f4000 bind=static:1 stack anon=4 dirty=4 active=1 N1=4 kernelpagesize_kB=4
garbage line
"""


def test_parse_numa_maps_fields() -> None:
    vmas = parse_numa_maps(SAMPLE)
    assert len(vmas) == 11
    lib = vmas[1]
    assert lib.file == "/opt/my app/lib.so" and lib.pages == {0: 4, 1: 6} and lib.kind == "file"
    assert vmas[2].kind == "heap" and vmas[2].anon == 300 and vmas[2].total_pages == 300
    assert vmas[3].kind == "anon" and vmas[3].policy == "interleave:0-1"
    assert vmas[4].policy == "prefer (many)=static:0-1"
    assert vmas[5].policy == "weighted interleave:0-1"
    assert vmas[6].kind == "huge" and vmas[6].page_size_kb == 2048 and vmas[6].special
    assert vmas[7].special  # /dev mapping
    assert vmas[8].kind == "special"  # vdso/vvar-like: policy only
    assert vmas[10].kind == "stack"


def test_task_policy_is_the_majority_of_ordinary_vmas() -> None:
    vmas = parse_numa_maps(SAMPLE)
    assert verify.task_policy_token(vmas) == "bind=static:1"
    # special VMAs never win, even when they are the majority
    only_special = parse_numa_maps("1000 default file=/dev/shm/x N0=1\n2000 default file=/dev/shm/y N0=1\n3000 local anon=1 N0=1\n")
    assert verify.task_policy_token(only_special) == "local"
    # nothing but special VMAs: fall back to all of them
    assert verify.task_policy_token(parse_numa_maps("1000 prefer:1\n")) == "prefer:1"
    assert verify.task_policy_token([]) is None


# ------------------------------------------------------------ fake /proc


def make_proc(
    root: Path,
    pid: int,
    threads: dict[int, tuple[str, str, str | None]],
    process_maps: str = "",
    state: dict[int, str] | None = None,
) -> Path:
    """threads: tid -> (name, Cpus_allowed_list, numa_maps text or None = missing file)."""
    pdir = root / str(pid)
    for tid, (name, cpus, maps) in threads.items():
        t = pdir / "task" / str(tid)
        t.mkdir(parents=True)
        st = (state or {}).get(tid, "S (sleeping)")
        (t / "status").write_text(
            f"Name:\t{name}\nState:\t{st}\nPid:\t{tid}\nCpus_allowed:\t3\nCpus_allowed_list:\t{cpus}\n"
            "Mems_allowed_list:\t0-1\n"
        )
        if maps is not None:
            (t / "numa_maps").write_text(maps)
    (pdir / "numa_maps").write_text(process_maps)
    return root


def maps_with(policy: str) -> str:
    return (
        f"1000 {policy} file=/usr/bin/python3 mapped=3 N1=3 kernelpagesize_kB=4\n"
        f"2000 {policy} heap anon=10 dirty=10 N1=10 kernelpagesize_kB=4\n"
        "3000 bind=static:0 anon=5 N0=5 kernelpagesize_kB=4\n"  # an mbind VMA: minority
        f"4000 {policy} stack anon=2 N1=2 kernelpagesize_kB=4\n"
    )


PROCESS_MAPS = (
    "1000 bind=static:1 file=/usr/bin/python3 mapped=3 N1=3 kernelpagesize_kB=4\n"
    "2000 bind=static:1 heap anon=95 N1=95 kernelpagesize_kB=4\n"
    "3000 bind=static:0 anon=2 N0=2 kernelpagesize_kB=4\n"
    "4000 bind=static:1 huge anon=1 N1=1 kernelpagesize_kB=2048\n"
)


def test_read_placement_on_a_hand_made_tree(tmp_path: Path) -> None:
    make_proc(
        tmp_path,
        42,
        {42: ("python3", "2-3", maps_with("bind=static:1")), 43: ("ZMQbg/IO/0", "2", maps_with("bind=static:1"))},
        PROCESS_MAPS,
    )
    obs = read_placement(42, str(tmp_path))
    assert [(t.tid, t.name, t.cpus, t.policy) for t in obs.threads] == [
        (42, "python3", (2, 3), "bind=static:1"),
        (43, "ZMQbg/IO/0", (2,), "bind=static:1"),
    ]
    assert obs.threads[0].mems_allowed == (0, 1)
    assert obs.pages_per_node == {1: 99, 0: 2}
    assert obs.bytes_per_node == {1: 98 * 4096 + 2048 * 1024, 0: 2 * 4096}
    share = obs.remote_share([1])
    assert share is not None and share == pytest.approx(2 * 4096 / obs.total_bytes)
    assert check_placement(obs, cpus=[2, 3], mempolicy="bind", nodes=[1]) == (True, [])


def test_cpu_mismatch_names_the_thread(tmp_path: Path) -> None:
    make_proc(
        tmp_path,
        7,
        {7: ("python3", "1", maps_with("bind=static:1")), 1234: ("ZMQbg/IO/0", "0-1", maps_with("bind=static:1"))},
    )
    ok, problems = check_placement(read_placement(7, str(tmp_path)), cpus=[1], mempolicy="bind", nodes=[1])
    assert not ok
    assert problems == ["thread 1234 (ZMQbg/IO/0) runs on 0-1, expected 1"]


def test_policy_mismatch_of_all_threads_is_one_line(tmp_path: Path) -> None:
    make_proc(tmp_path, 7, {7: ("a", "1", maps_with("bind=static:0")), 8: ("b", "1", maps_with("bind=static:0"))})
    ok, problems = check_placement(read_placement(7, str(tmp_path)), cpus=[1], mempolicy="bind", nodes=[1])
    assert (ok, problems) == (False, ["policy bind=static:0, expected bind=static:1"])


def test_policy_mismatch_of_one_thread_names_it(tmp_path: Path) -> None:
    make_proc(tmp_path, 7, {7: ("main", "1", maps_with("bind=static:1")), 9: ("early", "1", maps_with("default"))})
    ok, problems = check_placement(read_placement(7, str(tmp_path)), cpus=[1], mempolicy="bind", nodes=[1])
    assert (ok, problems) == (False, ["thread 9 (early) policy default, expected bind=static:1"])


@pytest.mark.parametrize(
    "token,mempolicy,nodes,ok",
    [
        ("bind=static:1", "bind", [1], True),
        ("bind:1", "bind", [1], True),            # numactl --membind spelling
        ("bind:0-1", "bind", [1], False),
        ("prefer:1", "preferred", [1], True),
        ("prefer=static:1", "preferred", [1], True),
        ("prefer:1", "bind", [1], False),
        ("local", "local", [], True),
        ("default", "local", [1], True),          # nodes ignored for local
        ("local", "default", [], True),
        ("interleave=static:0-1", "interleave", [0, 1], True),
        ("interleave:0-1", "interleave", [1, 0], True),
        ("interleave:0", "interleave", [0, 1], False),
        ("prefer (many)=static:0-1", "preferred_many", [0, 1], True),
        ("garbage", "bind", [1], False),
    ],
)
def test_policy_equivalence(token: str, mempolicy: str, nodes: list[int], ok: bool) -> None:
    assert verify.policy_matches(token, mempolicy, nodes) is ok


def test_static_ness_is_info_unless_required() -> None:
    obs = ObservedPlacement(5, (ThreadPlacement(5, "p", (1,), "bind:1"),), {}, {})
    assert check_placement(obs, cpus=[1], mempolicy="bind", nodes=[1]) == (True, [])
    ok, problems = check_placement(obs, cpus=[1], mempolicy="bind", nodes=[1], require_static=True)
    assert (ok, problems) == (False, ["policy bind:1, expected bind=static:1"])
    notes = verify.policy_notes(obs)
    assert len(notes) == 1 and "bind:1" in notes[0] and "no static flag" in notes[0]
    assert verify.policy_notes(ObservedPlacement(5, (ThreadPlacement(5, "p", (1,), "bind=static:1"),), {}, {})) == []


def test_vanished_and_exiting_threads_are_not_mismatches(tmp_path: Path) -> None:
    make_proc(
        tmp_path,
        10,
        {
            10: ("main", "1", maps_with("bind=static:1")),
            11: ("gone", "0-1", None),       # numa_maps vanished between listdir and read
            12: ("zombie", "0-1", maps_with("default")),
            13: ("exiting", "0-1", ""),      # mm already released: empty numa_maps
        },
        state={12: "Z (zombie)"},
    )
    (tmp_path / "10" / "task" / "14").mkdir()  # listed, then gone before status was read
    obs = read_placement(10, str(tmp_path))
    assert [t.tid for t in obs.threads] == [10]
    assert check_placement(obs, cpus=[1], mempolicy="bind", nodes=[1]) == (True, [])


def test_unreadable_policy_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_proc(tmp_path, 20, {20: ("main", "1", maps_with("bind=static:1"))})
    real = verify._read

    def deny(path: str, limit: int | None = None) -> str:
        if path.endswith("task/20/numa_maps"):
            raise PermissionError(13, "Permission denied")
        return real(path, limit)

    monkeypatch.setattr(verify, "_read", deny)
    obs = read_placement(20, str(tmp_path))
    assert obs.threads[0].policy is None
    ok, problems = check_placement(obs, cpus=[1], mempolicy="bind", nodes=[1])
    assert (ok, problems) == (False, ["thread 20 (main) memory policy unreadable: Permission denied"])


def test_gone_process_raises(tmp_path: Path) -> None:
    with pytest.raises(ProcessLookupError, match="process 99 is gone"):
        read_placement(99, str(tmp_path))


def test_policy_sample_bytes_reads_only_the_head(tmp_path: Path) -> None:
    big = "".join(f"{0x1000 * (i + 1):x} bind=static:1 anon=1 N1=1 kernelpagesize_kB=4\n" for i in range(50))
    tail = "".join(f"{0x900000 + i:x} default anon=1 N0=1 kernelpagesize_kB=4\n" for i in range(200))
    make_proc(tmp_path, 30, {30: ("m", "1", big + tail)})
    assert read_placement(30, str(tmp_path), policy_sample_bytes=2048).threads[0].policy == "bind=static:1"
    assert read_placement(30, str(tmp_path), policy_sample_bytes=None).threads[0].policy == "default"


def test_expected_policy_tokens() -> None:
    assert verify.expected_policy("bind", [1]).token() == "bind=static:1"
    assert verify.expected_policy("preferred", [0]).token() == "prefer=static:0"
    assert verify.expected_policy("interleave", [1, 0]).token() == "interleave=static:0-1"
    assert verify.expected_policy("local", [3]).token() == "local"


# ------------------------------------------------------- real processes

CHILD = r"""
import ctypes, os, sys, threading
libc = ctypes.CDLL(None)
ev = threading.Event()
def body(i):
    libc.prctl(15, b"worker-%d" % i, 0, 0, 0)   # PR_SET_NAME: shows in status Name
    ev.wait()
ts = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(3)]
for t in ts:
    t.start()
x = bytearray(8 << 20)
while len(os.listdir("/proc/self/task")) < 4:
    pass
print(os.getpid(), flush=True)
sys.stdin.readline()
ev.set()
"""

needs_cpu1 = pytest.mark.skipif(
    not {0, 1} <= os.sched_getaffinity(0) or not os.path.isdir("/sys/devices/system/node/node0"),
    reason="needs CPUs 0-1 and NUMA node 0",
)


def start_child(argv: list[str]) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip().isdigit(), line
    return p, int(line)


def stop_child(p: subprocess.Popen[str]) -> None:
    try:
        p.communicate("\n", timeout=20)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@needs_cpu1
def test_real_bound_child_is_seen_bound_in_every_thread() -> None:
    argv = launch.build_launch_argv([sys.executable, "-c", CHILD], cpus=[1], mempolicy="bind", nodes=[0])
    p, pid = start_child(argv)
    try:
        obs = read_placement(pid)
    finally:
        stop_child(p)
    assert pid == p.pid  # exec kept the pid
    assert len(obs.threads) == 4
    assert {t.name for t in obs.threads} >= {"worker-0", "worker-1", "worker-2"}
    assert all(t.cpus == (1,) and t.policy == "bind=static:0" for t in obs.threads), obs.threads
    assert check_placement(obs, cpus=[1], mempolicy="bind", nodes=[0]) == (True, [])
    assert obs.pages_per_node.get(0, 0) >= 2048  # the 8 MiB bytearray
    assert obs.remote_share([0]) == 0.0


@needs_cpu1
def test_reader_rechecks_a_real_process_cpus_by_syscall_and_sees_a_taskset_at_once() -> None:
    p, pid = start_child([sys.executable, "-c", CHILD])
    try:
        reader = verify.PlacementReader(policy_every=4)
        first = reader.read(pid)
        n = len(first.threads)
        assert n == 4 and reader.status_reads == n
        reader.status_reads = reader.policy_reads = 0
        again = reader.read(pid)                  # nothing changed: CPUs by syscall, no status, no numa_maps
        assert (reader.status_reads, reader.policy_reads) == (0, 0)
        assert [t.cpus for t in again.threads] == [t.cpus for t in first.threads]
        assert [t.name for t in again.threads] == [t.name for t in first.threads]
        moved = first.threads[-1].tid
        os.sched_setaffinity(moved, {0})          # what taskset -p does from outside
        obs = reader.read(pid)
        assert next(t.cpus for t in obs.threads if t.tid == moved) == (0,)
        assert (reader.status_reads, reader.policy_reads) == (0, 1)   # seen by syscall; one policy re-read
        ok, problems = check_placement(obs, cpus=[1], mempolicy="default", nodes=[0])
        assert f"thread {moved} ({first.threads[-1].name}) runs on 0, expected 1" in problems
        for _ in range(3):
            reader.read(pid)
        assert reader.status_reads == 0
        reader.read(pid)                          # the policy_every-th check since: every status in full
        assert reader.status_reads == n
    finally:
        stop_child(p)


@needs_cpu1
def test_real_unbound_child_is_reported() -> None:
    p, pid = start_child([sys.executable, "-c", CHILD])
    try:
        obs = read_placement(pid)
    finally:
        stop_child(p)
    ok, problems = check_placement(obs, cpus=[1], mempolicy="bind", nodes=[0])
    assert not ok
    from numaserve.cpulist import format_list

    here = format_list(os.sched_getaffinity(0))
    cpu_lines = [x for x in problems if " runs on " in x]
    assert len(cpu_lines) == 4  # every thread, each named
    assert f"thread {pid} (python3) runs on {here}, expected 1" in cpu_lines
    assert f"runs on {here}, expected 1" in cpu_lines[-1] and "(worker-" in cpu_lines[-1]
    assert "policy default, expected bind=static:0" in problems


@needs_cpu1
def test_check_self_in_a_bound_process() -> None:
    code = (
        "from numaserve.bind import numa, verify\n"
        "numa.set_cpu_affinity([1]); numa.set_mempolicy('bind', [0])\n"
        "print(verify.check_self([1], 'bind', [0]))\n"
        "print(verify.check_self([0], 'preferred', [0]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()
    assert first == "(True, [], (1,), 'bind=static:0')"
    assert second == (
        "(False, ['runs on 1, expected 0', 'policy bind=static:0, expected prefer=static:0'], (1,), 'bind=static:0')"
    )


# ------------------------------------------------------------ PlacementReader


def _set_thread(root: Path, pid: int, tid: int, name: str, cpus: str, maps: str) -> None:
    t = root / str(pid) / "task" / str(tid)
    t.mkdir(parents=True, exist_ok=True)
    (t / "status").write_text(f"Name:\t{name}\nState:\tS (sleeping)\nCpus_allowed_list:\t{cpus}\nMems_allowed_list:\t0-1\n")
    (t / "numa_maps").write_text(maps)


def test_reader_first_check_equals_a_full_read(tmp_path: Path) -> None:
    make_proc(tmp_path, 42, {42: ("python3", "2-3", maps_with("bind=static:1")),
                             43: ("ZMQbg/IO/0", "2", maps_with("bind=static:1"))}, PROCESS_MAPS)
    reader = verify.PlacementReader(str(tmp_path))
    assert reader.read(42) == read_placement(42, str(tmp_path))
    assert (reader.policy_reads, reader.pages_reads) == (2, 1)


def test_reader_rechecks_read_new_threads_cpus_and_one_known_policy(tmp_path: Path) -> None:
    make_proc(tmp_path, 50, {50: ("main", "1", maps_with("bind=static:1")),
                             51: ("io", "1", maps_with("bind=static:1"))}, PROCESS_MAPS)
    reader = verify.PlacementReader(str(tmp_path), pages_every=3)
    reader.read(50)
    reader.policy_reads = 0
    # a new thread started unbound, and an old one was moved to other CPUs
    _set_thread(tmp_path, 50, 52, "late", "1", maps_with("default"))
    _set_thread(tmp_path, 50, 51, "io", "0-1", maps_with("bind=static:1"))
    obs = reader.read(50)
    assert reader.policy_reads == 2          # the new thread + one known thread in turn
    ok, problems = check_placement(obs, cpus=[1], mempolicy="bind", nodes=[1])
    assert not ok
    assert problems == ["thread 51 (io) runs on 0-1, expected 1",
                        "thread 52 (late) policy default, expected bind=static:1"]
    assert reader.pages_reads == 1           # pages per node: first check, then every 3rd
    reader.read(50)
    assert reader.pages_reads == 1
    reader.read(50)
    assert reader.pages_reads == 2


def test_reader_finds_a_policy_changed_later_within_one_round(tmp_path: Path) -> None:
    threads = {t: (f"t{t}", "1", maps_with("bind=static:1")) for t in (60, 61, 62)}
    make_proc(tmp_path, 60, threads)
    reader = verify.PlacementReader(str(tmp_path))
    reader.read(60)
    _set_thread(tmp_path, 60, 61, "t61", "1", maps_with("prefer:0"))
    rounds = 3 * reader.policy_every         # nothing else changed: one policy every policy_every checks
    verdicts = [check_placement(reader.read(60), cpus=[1], mempolicy="bind", nodes=[1])[0] for _ in range(rounds)]
    assert False in verdicts                 # each known thread's policy is re-read within one round
    assert check_placement(reader.read(60), cpus=[1], mempolicy="bind", nodes=[1]) == (
        False, ["thread 61 (t61) policy prefer:0, expected bind=static:1"])


def test_reader_samples_policies_of_an_unchanged_process_and_reads_one_at_once_after_a_change(
        tmp_path: Path) -> None:
    """The thread list and every thread's CPUs and mems are read each check; numa_maps (the costly part)
    only every ``policy_every``-th check while they stay the same, and on the check that sees a change."""
    make_proc(tmp_path, 90, {90: ("main", "1", maps_with("bind=static:1")),
                             91: ("io", "1", maps_with("bind=static:1"))})
    reader = verify.PlacementReader(str(tmp_path), policy_every=4)
    reader.read(90)
    reader.policy_reads = 0
    for _ in range(8):
        reader.read(90)
    assert reader.policy_reads == 2              # checks 4 and 8
    _set_thread(tmp_path, 90, 91, "io", "0-1", maps_with("prefer:0"))   # moved by taskset, and its policy changed
    obs = reader.read(90)
    assert reader.policy_reads == 3              # the change itself brings a policy read
    assert "thread 91 (io) runs on 0-1, expected 1" in check_placement(obs, cpus=[1], mempolicy="bind", nodes=[1])[1]
    verdicts = [reader.read(90) for _ in range(2 * 4)]
    assert any(t.policy == "prefer:0" for o in verdicts for t in o.threads)   # within policy_every x threads


def test_reader_fresh_and_forget_start_over(tmp_path: Path) -> None:
    make_proc(tmp_path, 70, {70: ("main", "1", maps_with("bind=static:1"))})
    reader = verify.PlacementReader(str(tmp_path))
    reader.read(70)
    _set_thread(tmp_path, 70, 70, "main", "1", maps_with("default"))   # a new process on a reused pid
    assert reader.read(70, fresh=True).threads[0].policy == "default"
    reader.forget([])
    reader.policy_reads = 0
    reader.read(70)
    assert reader.policy_reads == 1


def test_reader_retries_unreadable_policies_and_raises_for_a_gone_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_proc(tmp_path, 80, {80: ("main", "1", maps_with("bind=static:1"))})
    real = verify._read
    denied = {"on": True}

    def deny(path: str, limit: int | None = None) -> str:
        if denied["on"] and path.endswith("task/80/numa_maps"):
            raise PermissionError(13, "Permission denied")
        return real(path, limit)

    monkeypatch.setattr(verify, "_read", deny)
    reader = verify.PlacementReader(str(tmp_path))
    assert reader.read(80).threads[0].policy is None
    denied["on"] = False
    assert reader.read(80).threads[0].policy == "bind=static:1"
    with pytest.raises(ProcessLookupError):
        reader.read(81)
