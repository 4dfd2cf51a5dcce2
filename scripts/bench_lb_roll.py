#!/usr/bin/env python3
"""Rolling restart behind a real HAProxy: failed requests with and without lb_grace.

    flock /tmp/numaserve-heavy.lock python3 scripts/bench_lb_roll.py [--rounds 2]

Three numaserve instances on loopback behind HAProxy running
deploy/haproxy/haproxy.cfg, under the same client load as
tests/integration/test_lb_haproxy.py (2 keep-alive GET, 2 new-connection GET,
1 keep-alive POST, 1 SSE-stream client); each instance is restarted in turn
with SIGTERM (wait for the exit, start, wait until HAProxy has it UP again).
Runs every combination of lb_grace (0 = readiness turns off and the drain
starts at the same moment; 3 s) and HAProxy retries (the shipped retries +
redispatch + retry-on; all off) in the same run, and prints the client's
failures by class and HAProxy's own error and retry counters.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.lbfleet import FleetLoad, HAProxy, Instance, is_up


def one_roll(lb_grace: float, retries: bool) -> dict:
    insts = [Instance(f"i{k}", lb_grace=lb_grace) for k in range(3)]
    lb = None
    try:
        for i in insts:
            i.start()
        lb = HAProxy([(i.name, i.port, i.admin_port) for i in insts], retries=retries)
        for i in insts:
            lb.wait_status(i.name, is_up, "UP")
        with FleetLoad(lb.port, keepalive=2, fresh=2, posts=1, streams=1, pace=0.02) as load:
            time.sleep(2)
            for i in insts:
                i.sigterm()
                i.wait_exit(60)
                i.close()
                i.start()
                lb.wait_status(i.name, is_up, "UP", timeout=60)
                time.sleep(1)
            time.sleep(1)
        stats = lb.stats()
        r = load.report
        hap = {k: sum(int(row.get(k) or 0) for n, row in stats.items() if n not in ("FRONTEND", "BACKEND"))
               for k in ("econ", "eresp", "wretr", "wredis")}
        return {"lb_grace": lb_grace, "haproxy_retries": retries, "ok": sum(r.ok.values()),
                "failed": r.failed, "failures": dict(r.failures), "haproxy": hap}
    finally:
        if lb is not None:
            lb.close()
        for i in insts:
            i.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for _ in range(args.rounds):
        for retries in (False, True):
            for grace in (0.0, 3.0):
                rows.append(one_roll(grace, retries))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"{'lb_grace':>8} {'HAProxy retries':>15} {'ok':>6} {'failed':>6}  failures by class / HAProxy econ eresp wretr wredis")
    for r in rows:
        h = r["haproxy"]
        print(f"{r['lb_grace']:>8g} {'on' if r['haproxy_retries'] else 'off':>15} {r['ok']:>6} {r['failed']:>6}  "
              f"{r['failures'] or '-'} / {h['econ']} {h['eresp']} {h['wretr']} {h['wredis']}")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
