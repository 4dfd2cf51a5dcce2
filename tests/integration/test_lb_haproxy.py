"""A rolling restart of three numaserve instances behind a real HAProxy loses nothing.

Three instances on loopback, HAProxy started from deploy/haproxy/haproxy.cfg
(health checks on each admin port's /readyz, as shipped) with every retry and
redispatch turned OFF, so any request numaserve drops or resets reaches the
client as an error instead of being hidden by a retry.  Under keep-alive,
new-connection, POST and SSE-stream load, scripts/fleet-roll restarts the
instances one at a time through its command hook; the hook does what
``systemctl restart`` does (SIGTERM, wait for the exit, start, wait until
ready).  The same roll with lb_grace = 0 fails hundreds of requests
(scripts/bench_lb_roll.py), so this test can fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration.harness import REPO
from tests.integration.lbfleet import HAPROXY, FleetLoad, HAProxy, Instance, is_up, wait_until

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(HAPROXY is None, reason="haproxy not installed (scripts/install)")]

FLEET_ROLL = REPO / "scripts" / "fleet-roll"

HOOK = """#!/bin/sh
# fleet-roll --restart-cmd hook: ask the test to restart instance $1, wait until it did
d="$(dirname "$0")"
: > "$d/$1.req"
i=0
while [ ! -e "$d/$1.done" ]; do
  sleep 0.05; i=$((i+1)); [ "$i" -gt 3000 ] && { echo "test never restarted $1" >&2; exit 124; }
done
rc=$(cat "$d/$1.done"); rm -f "$d/$1.done"; exit "$rc"
"""


class Restarter(threading.Thread):
    """Serves the hook's requests like systemctl restart: SIGTERM, wait, start, ready."""

    def __init__(self, instances: dict[str, Instance], d: Path) -> None:
        super().__init__(daemon=True)
        self.instances, self.d = instances, d
        self.stop = threading.Event()
        self.exit_codes: dict[str, int] = {}
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stop.wait(0.05):
            for name, inst in self.instances.items():
                req = self.d / f"{name}.req"
                if not req.exists():
                    continue
                req.unlink()
                rc = "0"
                try:
                    inst.sigterm()
                    self.exit_codes[name] = inst.wait_exit(60)
                    inst.close()
                    inst.start()
                except Exception as e:  # reported by the test, and the hook fails the roll
                    self.errors.append(f"{name}: {type(e).__name__}: {e}")
                    rc = "1"
                (self.d / f"{name}.done").write_text(rc)


def test_rolling_restart_behind_haproxy_loses_no_request(tmp_path: Path) -> None:
    names = ["numa-a", "numa-b", "numa-c"]
    instances = {n: Instance(n, lb_grace=3.0) for n in names}
    lb = None
    restarter = Restarter(instances, tmp_path)
    try:
        for inst in instances.values():
            inst.start()
        lb = HAProxy([(n, i.port, i.admin_port) for n, i in instances.items()], retries=False)
        for n in names:
            lb.wait_status(n, is_up, "UP")
        (tmp_path / "hook.sh").write_text(HOOK)
        restarter.start()
        cmd = [sys.executable, str(FLEET_ROLL), "--json", "--haproxy-socket", str(lb.socket_path),
               "--restart-cmd", f"sh {tmp_path / 'hook.sh'} {{name}}", "--ready-timeout", "60",
               "--lb-timeout", "60", "--pause", "1",
               *[f"{n}=127.0.0.1:{i.admin_port}" for n, i in instances.items()]]
        with FleetLoad(lb.port, keepalive=2, fresh=2, posts=1, streams=1, pace=0.02) as load:
            time.sleep(2.0)
            roll = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
            # traffic on the fully restarted fleet too (slowstart ramps the last one up)
            wait_until(lambda: all(load.report.answered_by[f"{n}.2"] for n in names), 30,
                       "every restarted instance to serve")
            time.sleep(1.0)
        report = load.report
        stats = lb.stats()
    finally:
        restarter.stop.set()
        if lb is not None:
            lb.close()
        for inst in instances.values():
            inst.close()
    assert roll.returncode == 0, f"fleet-roll failed:\n{roll.stderr}\n{restarter.errors}"
    hosts = json.loads(roll.stdout)
    assert [h["result"] for h in hosts] == ["rolled"] * 3, roll.stderr
    for h in hosts:
        assert h["left_lb"] and h["saw_readyz_503"] and not h["warnings"], h
    assert restarter.exit_codes == {n: 0 for n in names}, restarter.errors   # every stop was graceful
    assert report.failed == 0, report.summary()
    # both generations of every instance served, streams included
    for n in names:
        assert report.answered_by[f"{n}.1"] > 0 and report.answered_by[f"{n}.2"] > 0, report.summary()
    assert report.ok["stream"] > 0 and report.ok["post"] > 0, report.summary()
    # HAProxy saw no connection or response error on any server (it could not retry them anyway)
    for n in names:
        assert (stats[n]["econ"], stats[n]["eresp"]) == ("0", "0"), (n, stats[n])
        assert int(stats[n]["chkdown"]) >= 1, (n, stats[n])   # each one was taken out by its checks
