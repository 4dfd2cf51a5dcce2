import os
import socket

from numaserve.supervisor.notify import Notifier


def _sock(tmp_path):
    path = str(tmp_path / "notify.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(2)
    return s, path


def test_disabled_without_notify_socket():
    n = Notifier({})
    assert not n.enabled and n.send(READY=1) is False


def test_ready_sends_ready_status_and_first_watchdog_ping(tmp_path):
    s, path = _sock(tmp_path)
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
    assert n.watchdog_interval == 2.0
    n.ready("running: node0 2/2 ready")
    first = s.recv(4096).decode().split("\n")
    assert "READY=1" in first and "STATUS=running: node0 2/2 ready" in first and f"MAINPID={os.getpid()}" in first
    assert s.recv(4096) == b"WATCHDOG=1"
    n.ready("again")  # READY only once
    n.stopping()
    assert s.recv(4096).decode().startswith("STOPPING=1")


def test_watchdog_interval_ignored_for_other_pid(tmp_path):
    n = Notifier({"NOTIFY_SOCKET": "/nonexistent", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert n.watchdog_interval is None


def test_ping_due_every_half_interval(tmp_path):
    s, path = _sock(tmp_path)
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000"})
    assert not n.ping_due(0.0)  # not before READY
    n.ready("x")
    t = n.last_ping
    assert not n.ping_due(t + 0.4) and n.ping_due(t + 0.5)


def test_abstract_namespace_address():
    n = Notifier({"NOTIFY_SOCKET": "@foo"})
    assert n.address == "\0foo"


def test_reloading_carries_monotonic_usec(tmp_path):
    import time

    s, path = _sock(tmp_path)
    n = Notifier({"NOTIFY_SOCKET": path})
    n.ready("x")
    s.recv(4096)
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    n.reloading()
    lines = s.recv(4096).decode().split("\n")
    assert "RELOADING=1" in lines
    usec = int(next(x for x in lines if x.startswith("MONOTONIC_USEC="))[len("MONOTONIC_USEC="):])
    assert before <= usec <= time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000  # systemd >= 253 compares it
    n.reload_done("running: node0 1/1 ready (reload refused: bad)" + "x" * 5000)
    lines = s.recv(8192).decode().split("\n")
    assert lines[0] == "READY=1" and lines[1].startswith("STATUS=running: node0 1/1 ready (reload refused")
    assert len(lines[1]) <= len("STATUS=") + 1000


def test_no_reload_notifications_before_the_first_ready(tmp_path):
    """A READY=1 for a reload during start-up would end systemd's start before every slot is ready."""
    s, path = _sock(tmp_path)
    s.settimeout(0.2)
    n = Notifier({"NOTIFY_SOCKET": path})
    n.reloading()
    n.reload_done("refused")
    try:
        got = s.recv(4096)
    except socket.timeout:
        got = b""
    assert got == b""


def test_a_live_load_extends_systemds_start_timeout_until_ready(tmp_path):
    s, path = _sock(tmp_path)
    n = Notifier({"NOTIFY_SOCKET": path})
    n.created = 60.0
    assert n.extend_start(100.0) is False            # a short start needs no message
    assert n.extend_start(105.0) is True
    assert s.recv(4096) == b"EXTEND_TIMEOUT_USEC=60000000"
    assert n.extend_start(110.0) is False            # at most every EXTEND_EVERY_S
    assert n.extend_start(115.0) is True
    s.recv(4096)
    n.ready("running")
    s.recv(4096)
    assert n.extend_start(200.0) is False            # started: nothing left to extend


def test_status_line_shows_each_loading_slot_with_its_progress():
    import time

    from numaserve.bind.placement import SlotPlan
    from numaserve.supervisor import slots as S
    from numaserve.supervisor.backoff import RestartPolicy, RestartState
    from numaserve.supervisor.loadwatch import LoadProgress
    from numaserve.supervisor.notify import status_line

    slot = S.SlotState(plan=SlotPlan(slot=0, node=0, index=0, cpus=(0,), mempolicy="bind", memory_nodes=(0,)),
                       restart=RestartState(RestartPolicy()))
    w = S.WorkerProc(generation=1, popen=None, started=time.monotonic() - 42)  # type: ignore[arg-type]
    w.load = LoadProgress.begin(w.started)
    w.load.report(time.monotonic(), w.started + 40, 0.35, "layer 12/32")
    slot.worker = w
    assert status_line("starting", [slot]) == "starting: node0 0/1 ready (loading); slot 0 loading 40s 35% layer 12/32"


def test_a_status_line_nobody_reads_never_stalls_the_supervisor(tmp_path):
    s, path = _sock(tmp_path)            # bound, never read: its queue fills
    n = Notifier({"NOTIFY_SOCKET": path})
    sent = sum(n.send(STATUS=f"line {i}", wait=False) for i in range(500))
    assert 0 < sent < 500                # the rest dropped, not waited for
    n.status("and this returns too")
