"""Warm-template parts on fixtures and real (tiny) processes: thread diagnosis,
import-time environment check, smaps_rollup, the wire format, the forked-worker
handle, stray reaping, the preload hook, and the [worker] config keys."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

from numaserve.config import load_config
from numaserve.errors import ConfigError
from numaserve.supervisor.templates import import_time_mismatch, read_smaps_rollup
from numaserve.supervisor.workerproc import ForkedProcess, child_pids, reap_strays
from numaserve.worker import template as T
from numaserve.worker.preload import PreloadError, preload_done, run_preload


def test_describe_threads_names_python_and_native_threads_with_suspects() -> None:
    py = [("MainThread", 100, ""), ("exporter", 101, "myapp.metrics")]
    comms = {100: "python3", 101: "exporter", 102: "openblas_thd"}
    out = T.describe_threads(py, comms, ["numpy", "numpy.linalg", "json"], main_tid=100)
    assert out[0] == "python thread 'exporter' (tid 101, started by myapp.metrics)"
    assert "'openblas_thd' (tid 102)" in out[1] and "numpy (a BLAS/OpenMP pool" in out[1]
    assert T.describe_threads([("MainThread", 100, "")], {100: "python3"}, ["numpy"], main_tid=100) == []


def test_describe_threads_without_a_known_suspect_still_names_the_thread() -> None:
    out = T.describe_threads([], {1: "python3", 2: "worker"}, ["json"], main_tid=1)
    assert out == ["native threads 'worker' (tid 2)"]


def test_current_threads_sees_a_real_thread() -> None:
    import threading

    stop = threading.Event()
    th = threading.Thread(target=stop.wait, name="probe-thread", daemon=True)
    th.start()
    try:
        assert any("probe-thread" in line for line in T.current_threads())
    finally:
        stop.set()
        th.join()


def test_import_time_mismatch_only_counts_variables_read_at_load() -> None:
    tmpl = {"OMP_NUM_THREADS": "2", "NUMASERVE_SLOT": "0", "LD_PRELOAD": "", "SHARD": "a"}
    same = {"OMP_NUM_THREADS": "2", "NUMASERVE_SLOT": "3", "LD_PRELOAD": "", "SHARD": "b"}
    assert import_time_mismatch(tmpl, same) == []
    other = dict(same, OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="4", CUDA_VISIBLE_DEVICES="1")
    assert import_time_mismatch(tmpl, other) == ["CUDA_VISIBLE_DEVICES", "MALLOC_ARENA_MAX", "OMP_NUM_THREADS"]


def test_read_smaps_rollup(tmp_path: Path) -> None:
    d = tmp_path / "42"
    d.mkdir()
    (d / "smaps_rollup").write_text(
        "00400000-7ffd [rollup]\nRss:  1000 kB\nPss:  400 kB\nShared_Clean: 500 kB\nShared_Dirty: 100 kB\n"
        "Private_Clean: 150 kB\nPrivate_Dirty: 250 kB\n")
    assert read_smaps_rollup(42, str(tmp_path)) == {
        "rss_bytes": 1000 * 1024, "pss_bytes": 400 * 1024, "shared_bytes": 600 * 1024, "private_bytes": 400 * 1024}
    assert read_smaps_rollup(43, str(tmp_path)) is None
    assert read_smaps_rollup(os.getpid())["rss_bytes"] > 0


def test_wire_carries_json_and_fds_and_rejects_garbage() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    try:
        T.send_msg(a, {"t": "fork", "id": "x"}, [r])
        msg, fds = T.recv_msg(b)
        assert msg == {"t": "fork", "id": "x"} and len(fds) == 1
        os.write(w, b"hi")
        assert os.read(fds[0], 2) == b"hi"
        os.close(fds[0])
        socket.send_fds(a, [b"[1, 2]"], [r])
        with pytest.raises(ValueError):
            T.recv_msg(b)
        a.close()
        assert T.recv_msg(b) == (None, [])
    finally:
        for fd in (r, w):
            os.close(fd)
        b.close()


def test_template_refuses_to_fork_with_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(T, "current_threads", lambda: ["python thread 'x' (tid 7, started by m)"])
    tmpl = T.Template(T.TemplateSpec(node=0, generation=1, app="", app_dir="", preload="", control_fd=-1),
                      socket.socket(), None)
    reply = tmpl.handle({"t": "fork", "id": "1"}, [])
    assert reply["t"] == "refused" and "'x'" in reply["reason"] and reply["threads"]
    monkeypatch.setattr(T, "current_threads", lambda: [])
    assert tmpl.handle({"t": "fork", "id": "2"}, [])["t"] == "error"  # malformed: no spec
    assert tmpl.handle({"t": "what", "id": "3"}, [])["reason"].startswith("unknown request")
    tmpl.sock.close()


def _child(code: int, delay: float = 0.0) -> int:
    pid = os.fork()
    if pid == 0:
        time.sleep(delay)
        os._exit(code)
    return pid


def test_forked_process_handle_polls_waits_and_kills() -> None:
    p = ForkedProcess(_child(7, 0.2))
    assert p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.01)
    assert p.wait(5) == 7 and p.returncode == 7 and p.poll() == 7
    q = ForkedProcess(_child(0, 30))
    q.kill()
    assert q.wait(5) == -signal.SIGKILL
    q.kill()  # reaped: no signal to a pid that may be reused
    gone = ForkedProcess(999_999_999)
    assert gone.poll() == 255


def test_reap_strays_reaps_only_unknown_zombies() -> None:
    stray, kept = _child(3), _child(4)
    time.sleep(0.2)
    assert {stray, kept} <= set(child_pids())
    reaped = reap_strays([kept])
    assert (stray, 3) in reaped and all(pid != kept for pid, _ in reaped)
    assert ForkedProcess(kept).wait(5) == 4


def test_preload_runs_once_sync_or_async(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hooks_t.py").write_text(
        "CALLS = []\n"
        "def load():\n    CALLS.append('sync')\n"
        "async def aload():\n    CALLS.append('async')\n"
        "def boom():\n    raise OSError('disk gone')\n"
        "VALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    mod = importlib.import_module("hooks_t")
    assert run_preload("hooks_t:load") >= 0 and run_preload("hooks_t:load") == 0.0
    run_preload("hooks_t:aload")
    assert mod.CALLS == ["sync", "async"] and preload_done("hooks_t:load")
    with pytest.raises(PreloadError, match="OSError: disk gone"):
        run_preload("hooks_t:boom")
    with pytest.raises(PreloadError, match="not a function"):
        run_preload("hooks_t:VALUE")
    with pytest.raises(PreloadError, match="no attribute"):
        run_preload("hooks_t:missing")
    with pytest.raises(PreloadError, match="importing preload module"):
        run_preload("no_such_module_xyz:load")
    with pytest.raises(PreloadError, match="expected 'module:function'"):
        run_preload("justaname")


def _cfg(tmp_path: Path, text: str):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return load_config(p, environ={})


def test_worker_config_keys_are_typed_and_validated(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "")
    assert cfg.worker.start == "fork" and cfg.worker.preload == ""
    assert _cfg(tmp_path, '[worker]\nstart = "exec"\npreload = "m.n:load"\n').worker.start == "exec"
    with pytest.raises(ConfigError, match=r'worker\.start = "spawn": expected one of "fork", "exec"'):
        _cfg(tmp_path, '[worker]\nstart = "spawn"\n')
    with pytest.raises(ConfigError, match=r"worker\.preload = \"not a ref\": expected module:function"):
        _cfg(tmp_path, '[worker]\npreload = "not a ref"\n')
    with pytest.raises(ConfigError, match=r"worker\.preload .*server\.app set"):
        _cfg(tmp_path, '[server]\ncmd = "srv --fd {fd}"\n[worker]\npreload = "m:f"\n')
    with pytest.raises(ConfigError, match="environment NUMASERVE_WORKER_START"):
        load_config(tmp_path / "c.toml", environ={"NUMASERVE_WORKER_START": "clone"})


def test_template_metrics_from_status() -> None:
    from numaserve.supervisor.metrics import NumaserveCollector

    snap = {"supervisor": {}, "slots": [], "templates": {"nodes": [
        {"node": 1, "state": "ready", "generation": 2, "restarts": 1,
         "memory": {"pss_bytes": 10, "shared_bytes": 5, "private_bytes": 3}},
        {"node": 0, "state": "refused", "generation": 1, "restarts": 0, "memory": None}]}}
    got = {(f.name, s.labels.get("node")): s.value for f in NumaserveCollector(lambda: snap).collect()
           for s in f.samples if "template" in f.name}
    assert got[("numaserve_template_ready", "1")] == 1.0 and got[("numaserve_template_ready", "0")] == 0.0
    assert got[("numaserve_template_generation", "1")] == 2.0 and got[("numaserve_template_pss_bytes", "1")] == 10.0
    assert ("numaserve_template_pss_bytes", "0") not in got


def test_a_lowered_priority_is_only_taken_when_it_can_be_restored() -> None:
    from numaserve.worker.template import CAP_SYS_NICE, can_restore_priority

    assert can_restore_priority(0, 1 << CAP_SYS_NICE, 0)          # root-like: CAP_SYS_NICE
    assert not can_restore_priority(0, 0, 0)                        # default RLIMIT_NICE 0: nice 0 is out of reach
    assert can_restore_priority(0, 0, 20) and not can_restore_priority(0, 0, 19)
    assert can_restore_priority(5, 0, 15)                           # back to nice 5 needs 20 - 5


def _in_child(body: Callable[[], int]) -> int:
    """Run ``body`` in a forked child (the test process's own scheduling is never touched)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = body()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_boot_priority_runs_idle_then_nice_and_restores_everything() -> None:
    def body() -> int:
        before_nice = os.getpriority(os.PRIO_PROCESS, 0)
        old_handler = signal.getsignal(signal.SIGALRM)
        with T.BootPriority(10, idle_s=0.05) as bp:
            if bp.restore_nice is None:  # this environment cannot restore a priority: nothing changed
                return 0 if (os.getpriority(os.PRIO_PROCESS, 0) == before_nice
                             and os.sched_getscheduler(0) == os.SCHED_OTHER) else 2
            if os.sched_getscheduler(0) != os.SCHED_IDLE or not bp.idle:
                return 3
            deadline = time.monotonic() + 2.0
            while bp.idle and time.monotonic() < deadline:  # the timer ends the idle phase
                sum(range(10000))
            if bp.idle or os.sched_getscheduler(0) != os.SCHED_OTHER:
                return 4
            if os.getpriority(os.PRIO_PROCESS, 0) != min(19, before_nice + 10):
                return 5  # the bounded fallback: still lowered by nice
        if os.sched_getscheduler(0) != os.SCHED_OTHER or os.getpriority(os.PRIO_PROCESS, 0) != before_nice:
            return 6
        if signal.getsignal(signal.SIGALRM) != old_handler or signal.getitimer(signal.ITIMER_REAL)[0] != 0:
            return 7
        return 0

    assert _in_child(body) == 0


def test_boot_priority_left_early_disarms_its_timer_and_zero_changes_nothing() -> None:
    def body() -> int:
        with T.BootPriority(0) as bp:
            if bp.restore_nice is not None or bp.idle or os.sched_getscheduler(0) != os.SCHED_OTHER:
                return 2
        with T.BootPriority(10, idle_s=30.0):
            pass  # a boot shorter than the idle bound
        if signal.getitimer(signal.ITIMER_REAL)[0] != 0 or os.sched_getscheduler(0) != os.SCHED_OTHER:
            return 3
        return 0

    assert _in_child(body) == 0


def test_boot_priority_keeps_an_alarm_handler_the_app_installed() -> None:
    def body() -> int:
        def apps(*_: object) -> None:
            pass

        with T.BootPriority(10, idle_s=30.0):
            signal.signal(signal.SIGALRM, apps)  # the app's import wants SIGALRM for itself
        return 0 if signal.getsignal(signal.SIGALRM) is apps and os.sched_getscheduler(0) == os.SCHED_OTHER else 2

    assert _in_child(body) == 0


def test_boot_priority_leaves_a_policy_it_did_not_set_alone() -> None:
    def body() -> int:
        try:
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            return 0
        with T.BootPriority(10, idle_s=0.05) as bp:
            if bp.idle or os.sched_getscheduler(0) != os.SCHED_BATCH:
                return 2
        return 0 if os.sched_getscheduler(0) == os.SCHED_BATCH else 3

    assert _in_child(body) == 0


def test_lower_priority_restores_to_the_value_it_returns() -> None:
    import os

    from numaserve.worker.template import lower_priority

    assert lower_priority(0) is None
    before = os.getpriority(os.PRIO_PROCESS, 0)
    pid = os.fork()
    if pid == 0:  # in a child: the test process's own priority is never touched
        code = 1
        try:
            was = lower_priority(10)
            if was is None:
                code = 0 if os.getpriority(os.PRIO_PROCESS, 0) == before else 2  # not restorable: unchanged
            elif was == before and os.getpriority(os.PRIO_PROCESS, 0) == min(19, before + 10):
                os.setpriority(os.PRIO_PROCESS, 0, was)
                code = 0 if os.getpriority(os.PRIO_PROCESS, 0) == before else 3
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_status_view_shows_the_template_generation_and_its_zygote() -> None:
    from numaserve.cli.template_view import template_lines

    data = {"slots": [{"slot": 0, "start": {"mode": "fork", "template_pid": 11}}, {"slot": 1, "start": {"mode": "exec"}}],
            "templates": {"start": "fork", "nodes": [{
                "node": 0, "pid": 11, "generation": 3, "state": "ready", "forks": 2, "import_s": 0.05,
                "memory": {"pss_bytes": 10 << 20, "shared_bytes": 8 << 20, "private_bytes": 2 << 20},
                "started_by": "zygote",
                "zygote": {"pid": 7, "state": "ready", "templates_forked": 3, "last_exit": "SIGKILL",
                           "memory": {"pss_bytes": 5 << 20, "private_bytes": 1 << 20}}}]}}
    lines = template_lines(data, 200, lambda parts, width: [" ".join(parts)])
    assert lines[0].startswith("node 0 template pid 11 gen 3 ready forks 2 import 0.05s")
    assert lines[0].endswith("workers 0 started by zygote")
    assert lines[1] == "node 0 zygote pid 7 ready templates 3 pss 5.0M private 1.0M last exit SIGKILL"
    assert lines[2] == "exec'd (not forked): slots 1"


def test_a_template_generation_is_forked_from_the_zygote_only_when_it_matches() -> None:
    from types import SimpleNamespace

    from numaserve.bind.placement import SlotPlan
    from numaserve.supervisor.templates import READY, STARTING, TemplateManager, TemplateProc

    tm = TemplateManager(SimpleNamespace(), [])  # type: ignore[arg-type]
    plan = SlotPlan(slot=0, node=0, index=0, cpus=(0, 1), mempolicy="bind", memory_nodes=(0,))
    env = {"PYTHONPATH": "/a", "OMP_NUM_THREADS": "2", "NUMASERVE_SLOT": "0"}
    z = TemplateProc(node=0, generation=0, popen=None, sock=None, env=dict(env), mempolicy="bind",  # type: ignore[arg-type]
                     memory_nodes=(0,), cpus=(0, 1), started=0.0, state=READY, kind="zygote", cwd="/app")
    assert tm.zygote_mismatch(z, env, (0, 1), plan, "/app") is None
    assert tm.zygote_mismatch(z, env, (0,), plan, "/app") == "CPUs or memory policy changed"
    assert tm.zygote_mismatch(z, env, (0, 1), plan, "/other") == "server.app_dir changed"
    assert tm.zygote_mismatch(z, dict(env, PYTHONPATH="/b"), (0, 1), plan, "/app") == \
        "import-time variables changed (PYTHONPATH)"
    assert tm.zygote_mismatch(z, dict(env, NUMASERVE_SLOT="1"), (0, 1), plan, "/app") is None
    z.state = STARTING
    assert tm.zygote_mismatch(z, env, (0, 1), plan, "/app") == "zygote is starting"


def test_the_supervisor_ends_a_starting_templates_idle_phase_from_outside() -> None:
    """A SCHED_IDLE template on busy CPUs runs its own timer late; the supervisor's bound does not wait."""
    from types import SimpleNamespace

    from numaserve.supervisor.templates import STARTING, TemplateManager

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.write(w, b"1")
        except OSError:
            os.write(w, b"0")
        time.sleep(5)
        os._exit(0)
    os.close(w)
    try:
        if os.read(r, 1) != b"1":
            pytest.skip("SCHED_IDLE not available here")
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        TemplateManager._end_boot_idle(SimpleNamespace(pid=pid, state="ready"))  # not booting: left alone
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        TemplateManager._end_boot_idle(SimpleNamespace(pid=pid, state=STARTING))
        assert os.sched_getscheduler(pid) == os.SCHED_OTHER
    finally:
        os.close(r)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    TemplateManager._end_boot_idle(SimpleNamespace(pid=pid, state=STARTING))  # gone: no error


def test_trim_heap_gives_free_heap_pages_back_on_glibc() -> None:
    """The template's last step before it forks: glibc's malloc_trim is reached and answers (a bool:
    whether memory went back), not an error; None only where there is no glibc."""
    import ctypes.util

    junk = [bytes(4096) for _ in range(2000)]   # ~8 MB of small blocks, freed: free pages in the heap
    del junk
    got = T.trim_heap()
    if ctypes.util.find_library("c") is None:
        assert got is None
    else:
        assert isinstance(got, bool)


def test_zygote_trims_its_heap_after_its_imports_and_before_it_says_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    """Free heap pages go back before any template is forked (a template would copy them on write)."""
    import socket as socketmod
    from types import SimpleNamespace

    from numaserve.worker import zygote as Z

    calls: list[str] = []
    monkeypatch.setattr(Z, "_preimport", lambda names: calls.append("imports"))
    monkeypatch.setattr(Z, "trim_heap", lambda: calls.append("trim") or True)
    a, b = socketmod.socketpair(socketmod.AF_UNIX, socketmod.SOCK_SEQPACKET)
    try:
        log = SimpleNamespace(info=lambda *a, **k: calls.append("logged"))
        Z.Zygote(Z.ZygoteSpec(node=0, control_fd=a.fileno(), gc_freeze=False), a, log).boot()
        msg, _ = T.recv_msg(b)
        assert msg is not None and msg["t"] == "ready"
        assert calls == ["imports", "trim", "logged"]
    finally:
        a.close()
        b.close()


class _Recording(dict):  # type: ignore[type-arg]
    """A mapping that records what was written to it and deleted from it."""

    def __init__(self, *a: object) -> None:
        super().__init__(*a)
        self.writes: list[str] = []

    def __setitem__(self, key: str, value: str) -> None:
        self.writes.append(f"set {key}")
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self.writes.append(f"del {key}")
        super().__delitem__(key)


def test_replace_environ_writes_only_what_differs() -> None:
    env = _Recording({"KEEP": "1", "CHANGE": "old", "DROP": "x"})
    T.replace_environ({"KEEP": "1", "CHANGE": "new", "ADD": "a"}, env)
    assert dict(env) == {"KEEP": "1", "CHANGE": "new", "ADD": "a"}
    assert sorted(env.writes) == ["del DROP", "set ADD", "set CHANGE"]  # KEEP untouched


def test_replace_environ_reaches_the_c_environment_of_a_forked_child() -> None:
    """In a real forked child (as a forked worker does it): os.environ and what an exec'd child sees."""
    os.environ["NS_TEST_DROP"] = "gone"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r)
            target = {k: v for k, v in os.environ.items() if k != "NS_TEST_DROP"}
            target["NS_TEST_ADD"] = "here"
            T.replace_environ(target)
            out = subprocess.run(["env"], capture_output=True, text=True, check=True).stdout
            ok = ("NS_TEST_ADD=here" in out and "NS_TEST_DROP" not in out
                  and dict(os.environ) == target)
            os.write(w, b"ok" if ok else out.encode()[:2000])
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    try:
        got = os.read(r, 4096)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
        os.environ.pop("NS_TEST_DROP", None)
    assert got == b"ok", got


class _AlivePopen:
    """A template process that never answers; ``kill`` ends it (as SIGKILL would)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.returncode = -9


def _loading_template(pid: int) -> object:
    from numaserve.supervisor.templates import STARTING, TemplateProc

    return TemplateProc(node=0, generation=1, popen=_AlivePopen(pid), sock=None, env={},  # type: ignore[arg-type]
                        mempolicy="bind", memory_nodes=(0,), cpus=(0,), started=__import__("time").monotonic(),
                        state=STARTING)


def test_a_template_past_the_operators_deadline_is_killed_with_the_key_named_and_no_task_left() -> None:
    """Issue 31: the template wait leaves no asyncio task pending ("Task was destroyed but it is
    pending!") and a deadline, when one is set, is named in the reason."""
    import asyncio
    import os
    from types import SimpleNamespace

    import msgspec

    from numaserve.config import Config
    from numaserve.supervisor.templates import TemplateManager

    cfg = msgspec.structs.replace(Config(), supervisor=msgspec.structs.replace(
        Config().supervisor, ready_timeout=0.3, heartbeat_timeout=1000.0))
    tm = TemplateManager(SimpleNamespace(stopping=False), [])  # type: ignore[arg-type]
    t = _loading_template(os.getpid())

    async def go() -> list[object]:
        await tm._wait_ready([t], cfg)
        return [x for x in asyncio.all_tasks() if x is not asyncio.current_task()]

    assert asyncio.run(go()) == []
    assert t.popen.returncode == -9  # type: ignore[attr-defined]
    why = t.killed_for  # type: ignore[attr-defined]
    assert why.startswith("supervisor.ready_timeout = 0.3 exceeded while loading (elapsed ")
    assert why.endswith(" s); raise it or set 0 for none")


def test_a_loading_template_is_waited_for_without_a_deadline_until_the_supervisor_stops() -> None:
    import asyncio
    import os
    from types import SimpleNamespace

    from numaserve.config import Config
    from numaserve.supervisor.templates import TemplateManager

    sup = SimpleNamespace(stopping=False)
    tm = TemplateManager(sup, [])  # type: ignore[arg-type]
    t = _loading_template(os.getpid())   # this process: its CPU time moves, so it is alive and loading

    async def go() -> None:
        asyncio.get_running_loop().call_later(1.2, lambda: setattr(sup, "stopping", True))
        await tm._wait_ready([t], Config())

    asyncio.run(go())
    assert t.popen.returncode is None and t.killed_for is None  # type: ignore[attr-defined]
    assert t.load is not None and t.load.sample is not None      # type: ignore[attr-defined]
