"""numaserve.bind.locality: the stat ``processor`` field, hand-made /proc trees, a real process."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from numaserve.bind.locality import LocalitySample, parse_stat_processor, read_thread_cpus, sample_locality


def stat_line(comm: str, cpu: int) -> str:
    # fields 3..52 (state and 49 numbers); field 39 (index 36 after the comm) is the CPU
    rest = ["S"] + [str(i) for i in range(4, 53)]
    rest[36] = str(cpu)
    return f"123 ({comm}) " + " ".join(rest) + "\n"


def test_processor_is_field_39_even_with_spaces_and_parens_in_the_name() -> None:
    assert parse_stat_processor(stat_line("python3", 5)) == 5
    assert parse_stat_processor(stat_line("a) (b c", 17)) == 17
    assert parse_stat_processor("123 (x) S 1 2 3") is None      # cut short
    assert parse_stat_processor("garbage") is None


def make_proc(root: Path, pid: int, cpus: dict[int, int], numa_maps: str) -> None:
    pdir = root / str(pid)
    for tid, cpu in cpus.items():
        t = pdir / "task" / str(tid)
        t.mkdir(parents=True)
        (t / "stat").write_text(stat_line("w", cpu))
    (pdir / "numa_maps").write_text(numa_maps)


MAPS = ("00400000 bind=static:0 file=/usr/bin/python3 mapped=10 N0=10 kernelpagesize_kB=4\n"
        "00600000 bind=static:0 file=/usr/lib/libpython3.so anon=3 dirty=3 mapped=50 N1=50 kernelpagesize_kB=4\n"
        "7ffd0000 bind=static:0 file=/dev/shm/x mapped=9 N1=9 kernelpagesize_kB=4\n"
        "01000000 bind=static:0 heap anon=300 dirty=300 N0=200 N1=100 kernelpagesize_kB=4\n"
        "7f0000000000 bind=static:0 anon=2 dirty=2 N1=2 kernelpagesize_kB=2048\n")


def test_sample_counts_bytes_per_node_and_threads_off_the_node(tmp_path: Path) -> None:
    make_proc(tmp_path, 42, {42: 0, 43: 1, 44: 6}, MAPS)
    s = sample_locality(42, [0], [0, 1, 2, 3], str(tmp_path))
    # the file mapping (the interpreter's 10 pages on N0) is not the worker's own memory: left out
    assert s.bytes_per_node == {0: 200 * 4096, 1: 100 * 4096 + 2 * 2 * 1024 * 1024}
    assert s.local_ratio == pytest.approx(200 * 4096 / (300 * 4096 + 4 * 1024 * 1024))
    assert s.remote_nodes() == (1,)
    assert (s.threads, s.threads_off_node) == (3, 1)
    assert s.cost_s >= 0.0


def test_unknown_node_cpus_count_no_thread_off_node_and_empty_maps_give_no_ratio(tmp_path: Path) -> None:
    make_proc(tmp_path, 7, {7: 9}, "")
    s = sample_locality(7, [1], [], str(tmp_path))
    assert s.local_ratio is None and s.threads_off_node == 0 and s.remote_nodes() == ()


def test_a_gone_process_raises_process_lookup_error(tmp_path: Path) -> None:
    with pytest.raises(ProcessLookupError):
        sample_locality(99, [0], [0], str(tmp_path))


def test_a_real_process_is_all_local_on_a_one_node_view() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        cpus = read_thread_cpus(os.getpid())
        assert len(cpus) >= 2 and all(0 <= c < (os.cpu_count() or 1) for c in cpus.values())
        nodes = sorted(int(n[4:]) for n in os.listdir("/sys/devices/system/node") if n[4:].isdigit()
                       and n.startswith("node"))
        s = sample_locality(os.getpid(), nodes, range(os.cpu_count() or 1))
        assert s.total_bytes > 0 and s.local_ratio == 1.0 and s.threads_off_node == 0
    finally:
        stop.set()
        t.join()


def test_ratio_properties() -> None:
    s = LocalitySample(1, (0,), {0: 300, 1: 100})
    assert (s.total_bytes, s.local_bytes, s.remote_bytes, s.local_ratio) == (400, 300, 100, 0.75)
