"""systemd notification protocol, end to end: the real `numaserve start` talks to a
SOCK_DGRAM socket the test binds as $NOTIFY_SOCKET (what systemd does for Type=notify).

The watchdog contract this checks: WATCHDOG=1 comes from the supervisor's main
loop only, right after READY=1 and then every WatchdogSec/2.  A wedged loop
(simulated with SIGSTOP) sends nothing, and that silence is exactly what
systemd's WatchdogSec= acts on (SIGABRT, then Restart=).
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.integration.harness import FAST_CONFIG, Running

pytestmark = pytest.mark.slow

TWO = ["--nodes", "0", "--workers-per-node", "2", "--bind", "127.0.0.1:0"]
# Workers must not be declared hung while the supervisor is SIGSTOPped for 3 s.
CONFIG = FAST_CONFIG.replace("heartbeat_timeout = 3.0", "heartbeat_timeout = 10.0")
WATCHDOG_USEC = 2_000_000          # WatchdogSec=2 → a ping every ~1 s


class Msg:
    def __init__(self, wall: float, mono: float, fields: dict[str, str]) -> None:
        self.wall, self.mono, self.fields = wall, mono, fields

    def __repr__(self) -> str:
        return f"<{self.mono:.3f} {self.fields}>"


class NotifyListener:
    """Receives sd_notify datagrams with arrival times (a stand-in for systemd)."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="ns-notify-")
        self.path = os.path.join(self.dir, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[Msg] = []
        self.lock = threading.Lock()
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self.lock:
                self.messages.append(Msg(time.time(), time.monotonic(), fields))

    def snapshot(self) -> list[Msg]:
        with self.lock:
            return list(self.messages)

    def wait_for(self, pred: Callable[[Msg], bool], *, after: float = 0.0, timeout: float = 30.0,
                 what: str = "message") -> Msg:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for msg in self.snapshot():
                if msg.mono >= after and pred(msg):
                    return msg
            time.sleep(0.02)
        raise AssertionError(f"no {what} within {timeout}s; got {self.snapshot()[-15:]}")

    def pings(self, start: float, end: float) -> list[float]:
        return [m.mono for m in self.snapshot() if "WATCHDOG" in m.fields and start <= m.mono <= end]

    def wait_pings(self, n: int, *, after: float, timeout: float = 30.0) -> list[float]:
        """Poll until ``n`` WATCHDOG=1 have arrived after ``after`` (a condition, not a sleep)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.pings(after, float("inf"))
            if len(got) >= n:
                return got
            time.sleep(0.05)
        raise AssertionError(f"fewer than {n} WATCHDOG=1 within {timeout}s; got {self.snapshot()[-15:]}")

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        self.thread.join(2)
        Path(self.path).unlink(missing_ok=True)
        os.rmdir(self.dir)


@pytest.fixture()
def notify() -> Any:
    n = NotifyListener()
    yield n
    n.close()


def start(notify: NotifyListener) -> Running:
    return Running(TWO, config=CONFIG, env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": str(WATCHDOG_USEC)},
                   expect_ready=False)


def _ts(event: dict[str, Any]) -> float:
    return dt.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def test_ready_status_watchdog_reload_stopping(notify: NotifyListener) -> None:
    with start(notify) as sup:
        ready = notify.wait_for(lambda m: m.fields.get("READY") == "1", what="READY=1")
        # READY=1 carries the per-node summary and the main PID, and comes after every worker was ready
        assert ready.fields.get("MAINPID") == str(sup.proc.pid)
        assert "node0 2/2 ready" in ready.fields.get("STATUS", ""), ready.fields
        before = [m for m in notify.snapshot() if m.mono < ready.mono]
        assert not any("READY" in m.fields or "WATCHDOG" in m.fields for m in before), before
        worker_ready = [e for e in sup.events() if e.get("event") == "worker_ready"]
        assert len(worker_ready) == 2
        assert all(_ts(e) <= ready.wall + 0.05 for e in worker_ready), (worker_ready, ready.wall)

        # a watchdog ping right after READY, then about every WATCHDOG_USEC/2
        notify.wait_for(lambda m: "WATCHDOG" in m.fields, after=ready.mono, what="first WATCHDOG=1")
        pings = notify.wait_pings(4, after=ready.mono)
        gaps = [b - a for a, b in zip(pings, pings[1:])]
        assert all(g >= 0.8 for g in gaps), gaps    # paced at WATCHDOG_USEC/2, never a flood

        # a worker dies: STATUS shows it, then shows it back
        slot0 = sup.slots()[0]
        t_kill = time.monotonic()
        os.kill(slot0["pid"], signal.SIGKILL)
        down = notify.wait_for(lambda m: "STATUS" in m.fields and "2/2 ready" not in m.fields["STATUS"],
                               after=t_kill, what="STATUS with a slot down")
        assert "node0 1/2 ready" in down.fields["STATUS"], down.fields
        notify.wait_for(lambda m: m.fields.get("STATUS", "").endswith("node0 2/2 ready"), after=down.mono,
                        what="STATUS with the slot back")
        st = sup.wait_ready()
        gens = {s["slot"]: s["generation"] for s in st["slots"]}

        # SIGHUP: RELOADING=1 + MONOTONIC_USEC, then READY=1 once the rolling reload finished
        t_hup = time.monotonic()
        sup.signal(signal.SIGHUP)
        rel = notify.wait_for(lambda m: m.fields.get("RELOADING") == "1", after=t_hup, what="RELOADING=1")
        usec = int(rel.fields["MONOTONIC_USEC"])
        assert abs(usec / 1e6 - rel.mono) < 2.0   # CLOCK_MONOTONIC, same clock as ours
        back = notify.wait_for(lambda m: m.fields.get("READY") == "1", after=rel.mono, timeout=60,
                               what="READY=1 after the reload")
        st = sup.status()
        reloads = [o for o in st["operations"] if o["kind"] == "reload"]
        assert reloads and reloads[-1]["state"] == "succeeded", reloads
        assert all(s["generation"] == gens[s["slot"]] + 1 and s["state"] == "ready" for s in st["slots"]), st
        assert reloads[-1]["finished"] <= back.wall + 0.05
        # the watchdog kept pinging through the reload (the loop never stopped for it)
        notify.wait_pings(1, after=rel.mono)

        # SIGTERM: STOPPING=1, then a clean exit
        t_term = time.monotonic()
        sup.signal(signal.SIGTERM)
        notify.wait_for(lambda m: m.fields.get("STOPPING") == "1", after=t_term, what="STOPPING=1")
        assert sup.wait_exit(30) == 0


def test_watchdog_stops_while_the_main_loop_is_stuck(notify: NotifyListener) -> None:
    with start(notify) as sup:
        ready = notify.wait_for(lambda m: m.fields.get("READY") == "1", what="READY=1")
        notify.wait_pings(2, after=ready.mono)
        t_stop = time.monotonic()
        os.kill(sup.proc.pid, signal.SIGSTOP)     # the loop cannot run: nothing must ping for it
        try:
            time.sleep(3.0)
        finally:
            t_cont = time.monotonic()
            os.kill(sup.proc.pid, signal.SIGCONT)
        # datagrams sent just before the stop may be read a moment later
        silent = notify.pings(t_stop + 0.1, t_cont)
        assert silent == [], f"WATCHDOG=1 while stopped: {silent}"
        notify.wait_for(lambda m: "WATCHDOG" in m.fields, after=t_cont, timeout=10.0,
                        what="WATCHDOG=1 after SIGCONT")
        assert all(s["state"] == "ready" for s in sup.slots())   # nothing else was disturbed


def test_reload_notifications_follow_the_real_reload(notify: NotifyListener) -> None:
    """A SIGHUP during a reload must not end systemd's "reloading" early; a refused
    reload still answers RELOADING=1 with READY=1 (the reason in STATUS)."""
    with start(notify) as sup:
        notify.wait_for(lambda m: m.fields.get("READY") == "1", what="READY=1")
        sup.wait_ready()
        t_hup = time.monotonic()
        sup.signal(signal.SIGHUP)
        rel = notify.wait_for(lambda m: m.fields.get("RELOADING") == "1", after=t_hup, what="RELOADING=1")
        sup.signal(signal.SIGHUP)  # refused: a reload is running; must send nothing
        back = notify.wait_for(lambda m: m.fields.get("READY") == "1", after=rel.mono, timeout=60,
                               what="READY=1 after the reload")
        reloads = [o for o in sup.status()["operations"] if o["kind"] == "reload"]
        assert len(reloads) == 1 and reloads[0]["state"] == "succeeded", reloads
        assert reloads[0]["finished"] <= back.wall + 0.05, (reloads[0], back)
        between = [m for m in notify.snapshot() if rel.mono < m.mono < back.mono
                   and ("RELOADING" in m.fields or "READY" in m.fields)]
        assert between == [], between
        assert any(e.get("event") == "reload_refused" and "still running" in e.get("reason", "")
                   for e in sup.events())

        # a bad config: RELOADING=1, then READY=1 naming the refusal; nothing restarted
        gens = {s["slot"]: s["generation"] for s in sup.slots()}
        sup.config.write_text(CONFIG.replace("graceful_timeout = 10.0", 'graceful_timeout = "soon"'))
        t_bad = time.monotonic()
        sup.signal(signal.SIGHUP)
        rel = notify.wait_for(lambda m: m.fields.get("RELOADING") == "1", after=t_bad, what="RELOADING=1 (bad)")
        done = notify.wait_for(lambda m: m.fields.get("READY") == "1", after=rel.mono, what="READY=1 (refused)")
        assert "reload refused" in done.fields.get("STATUS", ""), done.fields
        assert {s["slot"]: s["generation"] for s in sup.slots()} == gens
