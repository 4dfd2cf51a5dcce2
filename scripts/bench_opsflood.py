#!/usr/bin/env python3
"""An ops-status flood from one read-only user: the supervisor's CPU, and root's `status` meanwhile (issue 34, 2).

    scripts/bench_opsflood.py [--connections 16] [--seconds 8] [--root-samples 20]

Starts a one-worker supervisor with ``ops.readonly_group = "nogroup"``; a
child as uid/gid 65534 opens ``--connections`` REQ connections to
``ops-ro.sock`` and sends ``status`` on each as fast as replies come, for
``--seconds``.  Measured: the supervisor process's CPU over the flood (utime
+ stime from /proc, as a share of one CPU), the replies the flooder got (ok
/ rate limited), and the latency of root's ``status`` (in-process client on
``ops.sock``) sampled during the flood.  Needs root (to act as another user).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import msgspec  # noqa: E402
import zmq  # noqa: E402

from numaserve.control import messages as m  # noqa: E402
from numaserve.control.client import ops_call  # noqa: E402
from tests.integration.harness import FAST_CONFIG, Running  # noqa: E402


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _flood(path: Path, connections: int, seconds: float, w: int) -> None:
    """Child: as nobody, hammer status on ``connections`` REQ sockets; write the counts to ``w``."""
    out = {"ok": 0, "limited": 0, "other": 0}
    try:
        os.setgroups([65534])
        os.setgid(65534)
        os.setuid(65534)
        ctx = zmq.Context()
        poller = zmq.Poller()
        socks = []
        payload = msgspec.msgpack.encode(m.OpsRequest(verb="status", id="flood"))
        for _ in range(connections):
            s = ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"ipc://{path}")
            s.send(payload)
            poller.register(s, zmq.POLLIN)
            socks.append(s)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for s, _ in poller.poll(100):
                rep = m.decode_ops_reply(s.recv())
                key = "ok" if rep.ok else "limited" if "rate limited" in rep.error else "other"
                out[key] += 1
                s.send(payload)
        ctx.destroy(0)
    finally:
        os.write(w, json.dumps(out).encode())
        os._exit(0)


def run(connections: int, seconds: float, samples: int) -> dict[str, Any]:
    cfg = FAST_CONFIG.replace('level = "info"', 'level = "warning"') + '\n[ops]\nreadonly_group = "nogroup"\n'
    with Running(["--nodes", "0", "--bind", "127.0.0.1:0"], config=cfg) as sup:
        pid = sup.proc.pid
        time.sleep(1.0)
        idle0, t0 = _cpu_s(pid), time.monotonic()
        time.sleep(2.0)
        idle_share = (_cpu_s(pid) - idle0) / (time.monotonic() - t0)
        r, w = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(r)
            _flood(sup.rt / "ops-ro.sock", connections, seconds, w)
        os.close(w)
        time.sleep(0.5)   # the flood is on
        c0, t0 = _cpu_s(pid), time.monotonic()
        lat = []
        gap = (seconds - 1.5) / samples
        for _ in range(samples):
            a = time.perf_counter()
            ops_call(sup.rt, "status", timeout=10)
            lat.append(1000 * (time.perf_counter() - a))
            time.sleep(gap)
        c1, t1 = _cpu_s(pid), time.monotonic()
        data = b""
        while chunk := os.read(r, 4096):
            data += chunk
        os.close(r)
        os.waitpid(child, 0)
    counts = json.loads(data)
    return {"connections": connections, "seconds": seconds, "flooder": counts,
            "flooder_replies_per_s": round(sum(counts.values()) / seconds, 1),
            "supervisor_cpu_share_idle": round(idle_share, 3),
            "supervisor_cpu_share_flood": round((c1 - c0) / (t1 - t0), 3),
            "root_status_ms": {"median": round(statistics.median(lat), 1), "max": round(max(lat), 1),
                               "samples": len(lat)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--root-samples", type=int, default=20)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_opsflood: needs root (the flood runs as uid 65534 in the read-only group)")
    print(json.dumps(run(a.connections, a.seconds, a.root_samples), indent=2))


if __name__ == "__main__":
    main()
