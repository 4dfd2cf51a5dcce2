"""The slots' state machine on fake processes: transitions, backoff, exit classification, watchdog."""

from __future__ import annotations

import signal

import msgspec
from slotfakes import FakeSlots

from numaserve.config import Config
from numaserve.supervisor import exits as X
from numaserve.supervisor import slots as S
from numaserve.supervisor.lifecycle import (
    EXIT_NO_SLOT,
    LAUNCH_EXIT_BIND_FAILED,
    WORKER_EXIT_APP_LOAD,
    describe_exit,
)


def started(n: int = 2, **kw: object) -> FakeSlots:
    f = FakeSlots(n, auto_ready=False, **kw)  # type: ignore[arg-type]
    for slot in f.slots.values():
        f.start_worker(slot, 0.0)
    return f


def ready(f: FakeSlots, now: float = 1.0) -> None:
    for slot in f.slots.values():
        assert slot.worker is not None
        f.on_ready(slot, slot.worker, now)


def test_start_then_ready_then_running() -> None:
    f = started()
    assert [s.state for s in f.slots.values()] == [S.STARTING, S.STARTING]
    assert [s.worker.generation for s in f.slots.values() if s.worker] == [1, 1]
    assert f.readiness(0.5, "starting") == "starting"
    ready(f)
    assert all(s.state == S.READY and s.ever_ready for s in f.slots.values())
    assert f.readiness(1.0, "starting") == "running"
    assert f.all_ready_logged


def test_a_crash_while_serving_backs_off_exponentially_then_restarts() -> None:
    f = started(1)
    ready(f)
    slot = f.slots[0]
    delays = []
    for i in range(2):
        w = slot.worker
        assert w is not None
        f.exit(w, 1, now=10.0 * (i + 1))
        assert slot.state == S.BACKOFF and slot.worker is None
        assert slot.last_exit_kind == X.CRASH
        delays.append(round(slot.next_start - 10.0 * (i + 1), 6))
        f.restart_due(slot.next_start - 0.01)
        assert slot.worker is None                 # not before the delay
        f.restart_due(slot.next_start)
        assert slot.state == S.STARTING and slot.worker is not None
        f.on_ready(slot, slot.worker, slot.next_start + 0.1)
    assert delays == [0.1, 0.2]                     # initial, doubled (jitter 0)
    assert slot.restarts == 2 and slot.generation == 3
    assert slot.totals_before.exits_by_kind == {X.CRASH: 2}


def test_crash_loop_fails_the_slot_and_a_retry_gets_one_attempt() -> None:
    f = started(2)
    ready(f)
    slot = f.slots[0]
    for t in (1.0, 2.0, 3.0):   # loop_limit=3 within the window
        if slot.worker is None:
            f.restart_due(slot.next_start)
        assert slot.worker is not None
        f.exit(slot.worker, 1, now=t)
    assert slot.state == S.FAILED and slot.next_retry == 3.0 + f.policy.failed_retry
    assert f.readiness(4.0, "running") == "degraded"
    t = slot.next_retry
    f.restart_due(t)
    assert slot.state == S.STARTING and slot.retrying
    f.exit(slot.worker, 1, now=t + 1)
    assert slot.state == S.FAILED                   # one failure sends a retried slot back
    t = slot.next_retry
    f.restart_due(t)
    f.on_ready(slot, slot.worker, t + 1)
    assert slot.state == S.READY and not slot.retrying and not slot.restart.crashes


def test_app_load_failure_at_boot_fails_fast_and_then_the_service() -> None:
    f = started(2)
    for slot in f.slots.values():
        slot.worker.goodbye = "app failed to load: No module named 'myapp'"
        f.exit(slot.worker, WORKER_EXIT_APP_LOAD, now=0.5)
    assert [s.state for s in f.slots.values()] == [S.FAILED, S.FAILED]
    assert f.slots[0].failed_reason == "app failed to load: No module named 'myapp'"
    assert f.slots[0].last_exit_kind == X.BOOT
    f.check_boot_failure()
    assert f.fatal is not None and "No module named 'myapp'" in f.fatal
    assert f.exit_code == EXIT_NO_SLOT


def test_a_boot_failure_after_the_service_served_is_retried_not_fatal() -> None:
    f = started(2)
    ready(f)
    slot = f.slots[0]
    f.exit(slot.worker, 1, now=5.0)
    f.restart_due(slot.next_start)
    f.exit(slot.worker, LAUNCH_EXIT_BIND_FAILED, now=5.5)   # never ready, binding failed
    assert slot.state == S.BACKOFF and slot.last_exit_kind == X.BOOT
    f.check_boot_failure()
    assert f.fatal is None


def test_sigkill_from_outside_restarts_at_once_and_is_not_a_crash() -> None:
    f = started(1)
    ready(f)
    slot = f.slots[0]
    f.exit(slot.worker, -signal.SIGKILL, now=30.0)
    assert slot.state == S.BACKOFF and slot.next_start == 30.0
    assert slot.last_exit_kind == X.EXTERNAL and "SIGKILL" in (slot.last_restart_reason or "")
    assert not slot.restart.crashes


def test_spawn_failure_backs_off_with_the_reason() -> None:
    f = FakeSlots(1, auto_ready=False)
    f.fail_spawn = "Too many open files"
    slot = f.slots[0]
    f.start_worker(slot, 0.0)
    assert slot.state == S.BACKOFF and slot.worker is None
    assert slot.last_restart_reason == "spawn failed: Too many open files"


def test_an_asked_stop_is_expected_not_restarted() -> None:
    f = started(1)
    ready(f)
    slot = f.slots[0]
    w = slot.worker
    w.stop_sent = 5.0
    f.exit(w, 0, now=6.0)
    assert slot.state == S.STOPPED and slot.restarts == 0


def test_watchdog_ready_timeout_sends_sigabrt_then_sigkill() -> None:
    cfg = msgspec.structs.replace(Config(), supervisor=msgspec.structs.replace(
        Config().supervisor, ready_timeout=60.0, heartbeat_timeout=1000.0))
    f = started(1, cfg=cfg)
    w = f.slots[0].worker
    w.hello = w.last_beat = None              # booting: no Hello yet, so no heartbeat to miss
    sup = cfg.supervisor
    f.watchdog(sup.ready_timeout - 1)
    assert f.signals == []
    f.watchdog(sup.ready_timeout + 0.1)
    assert f.signals == [(w.pid, signal.SIGABRT)]
    assert w.kill_reason == ("supervisor.ready_timeout = 60 exceeded while loading (elapsed 60 s); "
                             "raise it or set 0 for none")
    f.watchdog(sup.ready_timeout + 0.1 + sup.abort_grace)
    assert f.signals[-1] == (w.pid, signal.SIGKILL) and w.kill_sent is not None
    f.exit(w, -signal.SIGKILL, now=sup.ready_timeout + sup.abort_grace + 1)
    assert f.slots[0].last_exit_kind == X.HANG and f.slots[0].state == S.BACKOFF


def test_silent_worker_leaves_steering_then_is_killed_for_the_hang() -> None:
    cfg = msgspec.structs.replace(Config(), supervisor=msgspec.structs.replace(
        Config().supervisor, heartbeat_interval=1.0, heartbeat_timeout=10.0))
    f = started(1, cfg=cfg)
    ready(f, now=0.0)
    w = f.slots[0].worker
    w.last_beat = 0.0
    f.watchdog(2.5)                      # > 2 heartbeat intervals: unresponsive
    assert w.unresponsive_since == 2.5 and f.signals == []
    w.last_beat = 3.0
    f.watchdog(3.1)
    assert w.unresponsive_since is None       # back
    f.watchdog(13.5)
    assert f.signals == [(w.pid, signal.SIGABRT)] and w.kill_reason.startswith("hung: no heartbeat")


def test_a_stop_past_its_deadline_is_killed_and_counts_as_forced_while_stopping() -> None:
    cfg = Config()
    f = started(1, cfg=cfg)
    ready(f)
    w = f.slots[0].worker
    f.stopping = True
    w.stop_sent, w.stop_deadline = 1.0, 2.0
    f.watchdog(1.0 + 2.0 + cfg.supervisor.stop_timeout + 0.1)
    assert f.signals == [(w.pid, signal.SIGKILL)] and f.forced_kills


def test_describe_exit_names_signals_and_launcher_codes() -> None:
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL (out of memory?)"
    assert describe_exit(127) == "exit 127 (command not found)"
    assert describe_exit(None) == "running"


# ---------------------------------------------------------------- loading (issue 31)

def _loading_cfg(**kw: float) -> Config:
    return msgspec.structs.replace(Config(), supervisor=msgspec.structs.replace(
        Config().supervisor, heartbeat_interval=1.0, heartbeat_timeout=10.0, **kw))


def _sample(cpu: int, state: str = "R") -> object:
    from numaserve.supervisor.loadwatch import ProcSample

    return ProcSample(state=state, cpu_ticks=cpu, faults=0, rss_bytes=1 << 20, io_bytes=0)


def test_default_config_has_no_loading_deadline() -> None:
    assert Config().supervisor.ready_timeout == 0


def test_a_loading_worker_whose_cpu_time_moves_is_not_killed_without_heartbeats() -> None:
    f = started(1, cfg=_loading_cfg())
    slot = f.slots[0]
    w = slot.worker
    for t in range(0, 600, 5):                 # ten minutes holding the GIL: no beat, CPU moving
        f.samples[w.pid] = _sample(cpu=t)
        f.watchdog(float(t))
    assert f.signals == [] and w.kill_reason is None
    assert slot.status(600.0)["state"] == S.LOADING and slot.status(600.0)["loading"]["elapsed_s"] == 600.0


def test_a_loading_worker_with_no_sign_of_life_is_killed_as_stalled() -> None:
    f = started(1, cfg=_loading_cfg())
    w = f.slots[0].worker
    f.samples[w.pid] = _sample(cpu=7, state="D")
    for t in (1.0, 5.0, 10.0):
        f.watchdog(t)
    assert f.signals == []
    f.watchdog(10.5)
    assert f.signals == [(w.pid, signal.SIGABRT)]
    assert "stalled while loading" in w.kill_reason and "supervisor.heartbeat_timeout = 10" in w.kill_reason
    assert "state D" in w.kill_reason


def test_a_sigstopped_loading_worker_is_killed_and_retried_at_once() -> None:
    f = started(1, cfg=_loading_cfg())
    slot = f.slots[0]
    w = slot.worker
    f.samples[w.pid] = _sample(cpu=3, state="T")
    f.frozen = lambda pid: True
    f.watchdog(1.0)
    f.watchdog(11.0)
    assert f.signals == [(w.pid, signal.SIGABRT)] and w.kill_reason.startswith("frozen from outside (SIGSTOP)")
    f.exit(w, -signal.SIGKILL, now=12.0)
    assert slot.last_exit_kind == X.EXTERNAL and slot.state == S.BACKOFF and slot.next_start == 12.0


def test_sigkill_from_outside_while_loading_six_times_is_retried_never_failed_even_at_first_start() -> None:
    f = started(1)                             # nothing ever served; loop_limit 3
    slot = f.slots[0]
    for i in range(6):
        now = 1.0 + i
        if slot.worker is None:
            f.restart_due(slot.next_start)
        f.exit(slot.worker, -signal.SIGKILL, now=now)
        f.check_boot_failure()
        assert slot.state == S.BACKOFF and slot.last_exit_kind == X.EXTERNAL, i
        assert slot.next_start - now <= f.policy.maximum * (1 + f.policy.jitter)   # capped, not failed_retry
    assert f.fatal is None and f.exit_code == 0
    assert f.readiness(7.0, "starting") == "failed"      # every slot down: loudly failed, still retrying
    f.restart_due(slot.next_start)
    f.on_ready(slot, slot.worker, slot.next_start + 1)
    assert f.readiness(slot.next_start + 1, "failed") == "running"


def test_all_slots_down_is_failed_then_degraded_when_one_is_back() -> None:
    f = started(2)
    ready(f)
    for slot in f.slots.values():
        f.exit(slot.worker, -signal.SIGKILL, now=5.0)
    assert f.readiness(5.0, "running") == "failed"
    s0 = f.slots[0]
    f.restart_due(s0.next_start)
    assert f.readiness(5.1, "failed") == "failed"         # loading again is not serving
    f.on_ready(s0, s0.worker, 6.0)
    assert f.readiness(6.0, "failed") == "degraded"


def test_the_apps_own_boot_failure_at_first_start_still_exits_3() -> None:
    f = started(1)
    f.exit(f.slots[0].worker, WORKER_EXIT_APP_LOAD, now=1.0)
    f.check_boot_failure()
    assert f.exit_code == EXIT_NO_SLOT


def test_an_oom_kill_while_loading_is_named_with_the_cgroup_limit_and_peak_rss(tmp_path) -> None:
    from numaserve.supervisor.loadwatch import ProcSample

    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 0\noom_group_kill 0\n")
    (cg / "memory.max").write_text("536870912\n")
    f = FakeSlots(1, auto_ready=False)
    f.cgroup_of = lambda pid: str(cg)
    slot = f.slots[0]
    f.start_worker(slot, 0.0)
    w = slot.worker
    assert w.cgroup == str(cg) and w.oom_base == 0
    f.samples[w.pid] = ProcSample(state="R", cpu_ticks=1, faults=1, rss_bytes=500 << 20, io_bytes=1)
    f.watchdog(1.0)
    (cg / "memory.events").write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 1\noom_group_kill 0\n")
    f.exit(w, -signal.SIGKILL, now=2.0)
    assert slot.last_exit_kind == X.EXTERNAL and slot.state == S.BACKOFF
    assert slot.last_restart_reason == (f"killed by SIGKILL: OOM-killed (memory.events oom_kill "
                                        f"0 -> 1 in {cg}; memory.max 536870912; peak RSS seen 500 MiB)")


def test_cgroup_helpers_read_v2_files_and_say_none_otherwise(tmp_path) -> None:
    proc = tmp_path / "proc"
    (proc / "7").mkdir(parents=True)
    (proc / "7" / "cgroup").write_text("0::/system.slice/numaserve.service\n")
    assert X.cgroup_dir(7, proc=str(proc), root="/sys/fs/cgroup") == "/sys/fs/cgroup/system.slice/numaserve.service"
    (proc / "7" / "cgroup").write_text("12:memory:/x\n")       # cgroup v1: no unified line
    assert X.cgroup_dir(7, proc=str(proc)) is None
    assert X.cgroup_dir(8, proc=str(proc)) is None
    assert X.cgroup_oom_kills(str(tmp_path / "none")) is None and X.cgroup_memory_max(str(tmp_path)) is None


def test_a_cmd_worker_with_no_deadline_is_judged_by_its_process_tree() -> None:
    """``--cmd`` with ``ready_timeout = 0``: a command whose processes all stand still (``sleep 300``)
    is killed as stalled, so a reload waiting on it ends; one whose tree moves (a model loading in a
    child) may take as long as it needs; with a deadline set only the deadline applies."""
    f = started(1, cfg=_loading_cfg())
    w = f.slots[0].worker
    w.external = True
    f.samples[w.pid] = _sample(cpu=2, state="S")
    for t in (1.0, 5.0, 10.0):
        f.watchdog(t)
    assert f.signals == []
    f.watchdog(11.5)
    assert f.signals == [(w.pid, signal.SIGABRT)] and "stalled while loading" in w.kill_reason

    f = started(1, cfg=_loading_cfg())
    w = f.slots[0].worker
    w.external = True
    for t in range(0, 300, 5):                  # the tree's CPU time moves: loading, never killed
        f.samples[w.pid] = _sample(cpu=t)
        f.watchdog(float(t))
    assert f.signals == [] and w.kill_reason is None

    f = started(1, cfg=_loading_cfg(ready_timeout=60.0))
    w = f.slots[0].worker
    w.external = True
    f.samples[w.pid] = _sample(cpu=2, state="S")
    for t in (1.0, 20.0, 59.0):
        f.watchdog(t)
    assert f.signals == []                      # standing still, but the operator's deadline rules
    f.watchdog(61.0)
    assert f.signals == [(w.pid, signal.SIGABRT)] and "supervisor.ready_timeout" in w.kill_reason
