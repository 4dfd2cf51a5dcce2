"""numaserve.bind.numa: tokens, nodemask sizing, flag masking, input checks, real syscalls.

Real set_mempolicy calls run in a subprocess: the policy is per thread and
inherited, so setting it in the pytest process would leak into other tests.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from numaserve.bind import numa
from numaserve.bind.numa import MemPolicy, parse_numa_maps_token

ON_NODE0 = os.path.isdir("/sys/devices/system/node/node0")
needs_numa_syscalls = pytest.mark.skipif(
    os.uname().machine not in ("x86_64", "aarch64") or not ON_NODE0, reason="needs Linux NUMA syscalls"
)


def run_py(code: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


# ------------------------------------------------------------------- tokens

TOKENS = [
    ("default", MemPolicy("default")),
    ("local", MemPolicy("local")),
    ("prefer:1", MemPolicy("preferred", (1,))),
    ("prefer=static:1", MemPolicy("preferred", (1,), static=True)),
    ("bind:0", MemPolicy("bind", (0,))),
    ("bind=static:1", MemPolicy("bind", (1,), static=True)),
    ("bind=static:0-1,3", MemPolicy("bind", (0, 1, 3), static=True)),
    ("bind=balancing:0", MemPolicy("bind", (0,), balancing=True)),
    ("bind=static|balancing:2", MemPolicy("bind", (2,), static=True, balancing=True)),
    ("interleave:0-1", MemPolicy("interleave", (0, 1))),
    ("interleave=static:0-1", MemPolicy("interleave", (0, 1), static=True)),
    ("interleave=relative:0", MemPolicy("interleave", (0,), relative=True)),
    ("prefer (many):0-1", MemPolicy("preferred_many", (0, 1))),
    ("prefer (many)=static:0,2", MemPolicy("preferred_many", (0, 2), static=True)),
    ("weighted interleave:0-3", MemPolicy("weighted_interleave", (0, 1, 2, 3))),
]


@pytest.mark.parametrize("token,policy", TOKENS, ids=[t for t, _ in TOKENS])
def test_token_round_trip(token: str, policy: MemPolicy) -> None:
    assert parse_numa_maps_token(token) == policy
    assert policy.token() == token


@given(
    mode=st.sampled_from(sorted(numa.MODES)),
    nodes=st.sets(st.integers(0, 300), min_size=1, max_size=8),
    static=st.booleans(),
    relative=st.booleans(),
)
def test_token_round_trip_property(mode: str, nodes: set[int], static: bool, relative: bool) -> None:
    if mode in ("default", "local"):
        nodes = set()
    p = MemPolicy(mode, nodes, static=static, relative=relative and not static)
    assert parse_numa_maps_token(p.token()) == p


@pytest.mark.parametrize("bad", ["", "bogus:0", "bind=sticky:0", "bind:x", "bind:3-1", "interleave:0,,1"])
def test_bad_tokens_raise(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_numa_maps_token(bad)


def test_mempolicy_is_an_immutable_value() -> None:
    p = MemPolicy("bind", [1, 0, 1], static=True)
    assert p.nodes == (0, 1)
    assert p == MemPolicy("bind", (0, 1), static=True) and hash(p) == hash(MemPolicy("bind", (0, 1), static=True))
    assert p != MemPolicy("bind", (0, 1))
    with pytest.raises(AttributeError):
        p.mode = "local"  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown memory policy mode"):
        MemPolicy("membind")
    assert "bind" in repr(p)


# ----------------------------------------------------- sizing, flags, arch


@pytest.mark.parametrize(
    "nodes,nr,bits",
    [
        ((), 1, 128),          # 1 + 64 = 65 -> two words
        ((0,), 1, 128),
        ((), 64, 128),         # 64 + 64 exactly
        ((), 65, 192),
        ((64,), 1, 192),       # node 64 needs 65 bits + 64 slack
        ((1023,), 4, 1088),    # MAX_NUMNODES-sized request
        ((), 1024, 1088),
    ],
)
def test_nodemask_bits_robust_rule(nodes: tuple[int, ...], nr: int, bits: int) -> None:
    got = numa.nodemask_bits(nodes, nr)
    assert got == bits
    assert got % 64 == 0
    assert got >= max([nr] + [n + 1 for n in nodes]) + 64


def test_nr_node_ids_from_possible(tmp_path) -> None:
    (tmp_path / "possible").write_text("0-3\n")
    assert numa.nr_node_ids(str(tmp_path)) == 4
    (tmp_path / "possible").write_text("0,8,250-255\n")
    assert numa.nr_node_ids(str(tmp_path)) == 256
    assert numa.nr_node_ids(str(tmp_path / "missing")) == 1


def test_decode_mode_masks_flags() -> None:
    assert numa.decode_mode(32770) == ("bind", True, False, False)  # BIND|STATIC, as measured
    assert numa.decode_mode(2) == ("bind", False, False, False)
    assert numa.decode_mode(3 | numa.MPOL_F_RELATIVE_NODES) == ("interleave", False, True, False)
    assert numa.decode_mode(2 | numa.MPOL_F_NUMA_BALANCING) == ("bind", False, False, True)
    assert numa.decode_mode(4) == ("local", False, False, False)
    with pytest.raises(ValueError, match="unknown memory policy mode number 9"):
        numa.decode_mode(9 | numa.MPOL_F_STATIC_NODES)


def test_syscall_numbers_per_arch() -> None:
    assert numa.syscall_numbers("x86_64") == {"mbind": 237, "set_mempolicy": 238, "get_mempolicy": 239,
                                            "migrate_pages": 256}
    assert numa.syscall_numbers("aarch64") == {"mbind": 235, "set_mempolicy": 237, "get_mempolicy": 236,
                                             "migrate_pages": 238}
    with pytest.raises(numa.UnsupportedArchitecture, match="riscv64.*refusing to guess") as ei:
        numa.syscall_numbers("riscv64")
    assert ei.value.errno == errno.ENOSYS


# ----------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "mode,nodes,match",
    [
        ("bind", [-1], "must be >= 0"),
        ("bind", [], "needs at least one node"),
        ("interleave", [], "needs at least one node"),
        ("preferred", [], "needs at least one node"),
        ("local", [0], "takes no nodes"),
        ("default", [1], "takes no nodes"),
        ("membind", [0], "unknown memory policy"),
        ("bind", [1 << 20], "larger than any kernel supports"),
        ("bind", ["x"], "bad node id"),
    ],
)
def test_set_mempolicy_rejects_bad_input_before_the_syscall(mode: str, nodes: list, match: str) -> None:
    # ValueError comes before any syscall, so this is safe in the test process.
    with pytest.raises(ValueError, match=match):
        numa.set_mempolicy(mode, nodes)


def test_set_cpu_affinity_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="empty"):
        numa.set_cpu_affinity([])
    with pytest.raises(ValueError, match="negative"):
        numa.set_cpu_affinity([-1])


# -------------------------------------------------------- real syscalls

PROBE = """
import json, sys
from numaserve.bind import numa
mode, nodes, static = sys.argv[1], [int(n) for n in sys.argv[2].split(",") if n], sys.argv[3] == "1"
out = {}
try:
    numa.set_mempolicy(mode, nodes, static=static)
except OSError as e:
    out["error"] = [e.errno, e.strerror]
p = numa.get_mempolicy()
out["get"] = [p.mode, list(p.nodes), p.static, p.token()]
maps = open("/proc/self/numa_maps").read().split("\\n")
out["maps"] = sorted({l.split()[1] for l in maps if l and "file=" in l})
print(json.dumps(out))
"""


def probe(mode: str, nodes: str = "", static: bool = True) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", PROBE, mode, nodes, "1" if static else "0"], capture_output=True, text=True, timeout=30
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@needs_numa_syscalls
def test_bind_node0_reads_back_static_in_numa_maps() -> None:
    out = probe("bind", "0")
    assert "error" not in out
    assert out["get"] == ["bind", [0], True, "bind=static:0"]
    assert out["maps"] == ["bind=static:0"]  # every VMA without own policy


@needs_numa_syscalls
def test_bind_without_static_flag_matches_numactl_spelling() -> None:
    out = probe("bind", "0", static=False)
    assert out["get"] == ["bind", [0], False, "bind:0"]
    assert out["maps"] == ["bind:0"]


@needs_numa_syscalls
@pytest.mark.parametrize(
    "mode,nodes,token",
    [("preferred", "0", "prefer=static:0"), ("interleave", "0", "interleave=static:0"), ("local", "", "local"),
     ("default", "", "default")],
)
def test_other_modes_read_back(mode: str, nodes: str, token: str) -> None:
    out = probe(mode, nodes)
    assert "error" not in out, out
    assert out["get"][3] == token
    assert out["maps"] == [token]


@needs_numa_syscalls
def test_bind_to_missing_node_is_a_clear_error() -> None:
    n = max(numa.nr_node_ids(), 5)
    out = probe("bind", str(n))
    err, msg = out["error"]
    assert err == errno.EINVAL
    assert msg.startswith(f"set_mempolicy(bind, nodes={n}): Invalid argument — node {n} is not online/allowed"), msg
    assert out["get"][0] == "default"  # the failed call changed nothing


@needs_numa_syscalls
def test_cpu_affinity_real() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    last = cpus[-1]
    r = run_py(
        f"""
        from numaserve.bind import numa
        numa.set_cpu_affinity([{last}])
        print(numa.get_cpu_affinity())
        try:
            numa.set_cpu_affinity([4095])
        except OSError as e:
            print(e.errno, e.strerror)
        """
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"({last},)"
    assert lines[1].startswith("22 sched_setaffinity(cpus=4095): Invalid argument")


@needs_numa_syscalls
def test_matches_libnuma_when_present() -> None:
    if not numa.libnuma_available():
        pytest.skip("libnuma.so.1 not installed")
    r = run_py(
        """
        import ctypes
        from numaserve.bind import numa
        numa.set_mempolicy("bind", [0])
        lib = ctypes.CDLL("libnuma.so.1")
        lib.numa_get_membind.restype = ctypes.c_void_p
        lib.numa_bitmask_isbitset.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        bm = lib.numa_get_membind()
        print(lib.numa_bitmask_isbitset(bm, 0), numa.get_mempolicy().token())
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "bind=static:0"]


def test_numa_module_imports_nothing_from_the_package() -> None:
    """launch.py loads numa.py by path under -I -S: it must stay stdlib-only."""
    import ast

    tree = ast.parse(open(numa.__file__).read())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in mods if m.split(".")[0] == "numaserve"}
    r = subprocess.run(
        [sys.executable, "-I", "-S", "-c",
         "import importlib.util as u, sys; s=u.spec_from_file_location('m', sys.argv[1]); m=u.module_from_spec(s);"
         "s.loader.exec_module(m); print(sorted(k for k in sys.modules if k in ('typing','dataclasses','numaserve')))",
         numa.__file__],
        capture_output=True, text=True, timeout=30,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
