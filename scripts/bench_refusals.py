#!/usr/bin/env python3
"""What a refusal costs the worker's loop, kept connection versus closed (issue 32, cheap refusals).

    scripts/bench_refusals.py [--n 3000] [--reps 3]

One worker stack (``build_stack``, defaults, the sentinel off) on this
process's loop with a pushed ceiling of 0, so every request is refused
(503 ``limit``) at head-complete; a client in a subprocess sends ``--n``
GETs one after another:

* ``kept``: one keep-alive connection (what a refused GET gets now);
* ``closed``: each GET on a new connection with ``Connection: close`` (the
  path every refusal took before: answer, FIN, lingering read, close, and
  the client's next TCP handshake);
* ``served``: the ceiling lifted, keep-alive 200s (a reference).

Printed per mode: requests/s seen by the client and the loop thread's CPU
per request (µs).  Both share the host's CPUs: read the ratio, not the values.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # numaserve from this checkout

CLIENT = r"""
import socket, sys, time
port, n, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
def read_one(s, buf):
    while b"\r\n\r\n" not in buf:
        d = s.recv(65536)
        if not d: raise SystemExit("closed early")
        buf += d
    head, _, rest = buf.partition(b"\r\n\r\n")
    n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(rest) < n:
        rest += s.recv(65536)
    return head, rest[n:]
t0 = time.perf_counter()
if mode == "closed":
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        read_one(s, b"")
        s.close()
else:
    s = socket.create_connection(("127.0.0.1", port))
    buf = b""
    for _ in range(n):
        s.sendall(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
        head, buf = read_one(s, buf)
    s.close()
print(time.perf_counter() - t0)
"""


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            m = await receive()
            await send({"type": m["type"] + ".complete"})
            if m["type"] == "lifespan.shutdown":
                return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def measure(n: int, reps: int) -> dict[str, list[tuple[float, float]]]:
    from numaserve.framing import FramingConfig
    from numaserve.loops.admission import AdmissionSettings
    from numaserve.worker.edge import build_stack
    from numaserve.worker.serve import WorkerServer
    from numaserve.worker.spec import flat_spec
    from numaserve.worker.stats import WorkerStats

    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1024)
    spec = flat_spec(slot=0, node=0, generation=1, cpus=[0], node_cpus=[0], mempolicy="local", memory_nodes=[0],
                     fd=-1, control="ipc:///nonexistent", framing=FramingConfig(enabled=False),
                     admission=AdmissionSettings(sentinel=False))
    stack = build_stack(spec, app, WorkerStats())
    server = WorkerServer(stack.config)
    task = asyncio.ensure_future(server.serve(sockets=[socket.socket(fileno=os.dup(lst.fileno()))]))
    while not server.started:
        await asyncio.sleep(0.01)
    gate = stack.runtime.gate
    port = lst.getsockname()[1]
    out: dict[str, list[tuple[float, float]]] = {"kept": [], "closed": [], "served": []}
    epoch = 0
    for _ in range(reps):
        for mode in out:
            epoch += 1
            gate.set_limits(0.0, epoch, concurrency=None if mode == "served" else 0)
            cpu0 = time.thread_time()
            proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, str(port), str(n), mode,
                                                        stdout=subprocess.PIPE)
            stdout, _ = await proc.communicate()
            cpu = time.thread_time() - cpu0
            wall = float(stdout)
            out[mode].append((n / wall, cpu / n * 1e6))
    stack.runtime.probe.stop()
    server.should_exit = True
    await task
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=3000, help="requests per mode and repetition")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    out = asyncio.run(measure(a.n, a.reps))
    print(f"{'mode':8} {'req/s (median)':>15} {'loop CPU µs/req (median, min)':>30}")
    for mode, rows in out.items():
        rates = [r for r, _ in rows]
        cpus = [c for _, c in rows]
        print(f"{mode:8} {statistics.median(rates):15.0f} {statistics.median(cpus):22.1f} {min(cpus):7.1f}")


if __name__ == "__main__":
    main()
