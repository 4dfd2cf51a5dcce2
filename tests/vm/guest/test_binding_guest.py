"""Birth-time binding on a real 2-node kernel (runs inside the lab VM only).

``numaserve exec --node N`` and the launcher must put every thread of the new
program on node N's CPUs with ``bind=static:N``, and its pages on node N;
``read_placement``/``check_placement`` (from outside) must agree with what the
program sees from inside.  Node sizes in the VM are ~460/500 MB: allocations
stay <= 200 MB.
"""

from __future__ import annotations

import json
import subprocess
import sys

from numaserve.bind.launch import build_launch_argv
from numaserve.bind.verify import check_placement, read_placement

PY = sys.executable

# argv[1] = MiB to allocate.  Starts 3 threads after exec (they inherit the
# binding), touches every page, prints one JSON line and waits for stdin so the
# test can read /proc from outside while it is alive.
CHILD = r"""
import json, os, re, sys, threading
mib = int(sys.argv[1])
ev = threading.Event()
ts = [threading.Thread(target=ev.wait, daemon=True) for _ in range(3)]
for t in ts:
    t.start()
buf = bytearray(mib << 20)
buf[::4096] = b"\x01" * len(range(0, len(buf), 4096))   # touch every page
threads = {}
for tid in sorted(os.listdir("/proc/self/task")):
    st = open(f"/proc/self/task/{tid}/status").read()
    cpus = re.search(r"Cpus_allowed_list:\s*(\S+)", st).group(1)
    pols = [l.split()[1] for l in open(f"/proc/self/task/{tid}/numa_maps") if "file=" in l or " heap " in l]
    threads[tid] = [cpus, max(set(pols), key=pols.count)]
big = {}
want = (mib << 20) // 4096
for line in open("/proc/self/numa_maps"):
    m = re.search(r"\banon=(\d+)", line)
    if m and int(m.group(1)) >= want * 0.9:
        for n, c in re.findall(r"\bN(\d+)=(\d+)", line):
            big[n] = big.get(n, 0) + int(c)
print(json.dumps({"pid": os.getpid(), "threads": threads, "big_vma_pages": big, "want_pages": want}), flush=True)
sys.stdin.readline()
ev.set()
"""


def run_bound(prefix: list[str], mib: int) -> tuple[dict, object, int]:
    """Start CHILD under ``prefix``; return (its report, placement read from outside, exit status)."""
    p = subprocess.Popen(
        prefix + [PY, "-c", CHILD, str(mib)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert p.stdout is not None and p.stdin is not None
        line = p.stdout.readline()
        if not line:
            raise AssertionError(f"child produced no report; exit {p.wait(60)}; stderr: {p.stderr.read() if p.stderr else ''}")
        report = json.loads(line)
        observed = read_placement(report["pid"])
        p.stdin.write("\n")
        p.stdin.flush()
        rc = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert report["pid"] == p.pid  # exec chain kept the pid
    return report, observed, rc


def assert_bound(report: dict, observed, node: int, cpus: tuple[int, ...], min_share: float = 0.95) -> None:
    from numaserve.cpulist import parse_list

    assert len(report["threads"]) == 4, report
    for tid, (cpulist, policy) in report["threads"].items():
        assert set(parse_list(cpulist)) <= set(cpus), f"thread {tid} on {cpulist}, node {node} has {cpus}"
        assert policy == f"bind=static:{node}", f"thread {tid}: {policy}"
    pages = {int(k): v for k, v in report["big_vma_pages"].items()}
    on_node = pages.get(node, 0)
    assert on_node >= min_share * report["want_pages"], f"pages per node of the big VMA: {pages}"
    # the outside view agrees with the inside view
    assert sorted(str(t.tid) for t in observed.threads) == sorted(report["threads"])
    for t in observed.threads:
        assert set(t.cpus) <= set(cpus) and t.policy == f"bind=static:{node}", t
    ok, problems = check_placement(observed, cpus=cpus, mempolicy="bind", nodes=[node])
    assert ok, problems
    assert observed.pages_per_node.get(node, 0) >= on_node


def test_exec_node1_binds_every_thread_and_200mb(node_cpus: dict[int, tuple[int, ...]]) -> None:
    report, observed, rc = run_bound([PY, "-m", "numaserve", "exec", "--node", "1", "--"], 200)
    assert rc == 0
    assert_bound(report, observed, 1, node_cpus[1])
    share = observed.remote_share([1])
    print(f"node 1: big VMA pages {report['big_vma_pages']}, process remote share {share:.3f}")


def test_exec_node0_works_too(node_cpus: dict[int, tuple[int, ...]]) -> None:
    report, observed, rc = run_bound([PY, "-m", "numaserve", "exec", "--node", "0", "--"], 64)
    assert rc == 0
    assert_bound(report, observed, 0, node_cpus[0])


def test_launcher_binds_node1_with_cpu_subset(node_cpus: dict[int, tuple[int, ...]]) -> None:
    cpu = node_cpus[1][-1]
    argv = build_launch_argv(["X"], cpus=[cpu], mempolicy="bind", nodes=[1])[:-1]
    report, observed, rc = run_bound(argv, 32)
    assert rc == 0
    assert_bound(report, observed, 1, (cpu,))


def test_launcher_bad_node_fails_126_with_clear_message() -> None:
    argv = build_launch_argv(["true"], cpus=None, mempolicy="bind", nodes=[7])
    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert r.returncode == 126
    assert r.stderr.strip().startswith(
        "numaserve-launch: set_mempolicy(bind, nodes=7): Invalid argument — node 7 is not online/allowed"
    ), r.stderr
    assert "nodes with memory: 0-1" in r.stderr
