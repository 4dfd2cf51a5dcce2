#!/usr/bin/env python3
"""Batched vs unbatched throughput of the demo's /v1/embeddings under `numaserve start`.

Starts the real supervisor twice on loopback (one worker; the demo with
``NUMASERVE_DEMO_BATCH=1`` and ``=0``), drives each with C concurrent
requests for a few seconds per level (framed protocol by default, or HTTP
keep-alive), and prints requests/s, p50/p99 latency and the speedup.
Admission control is switched off for the run: the point is the model's
throughput, not shedding.  Bounded: every level runs ``--seconds``.

    python scripts/bench_batching.py [--levels 1,8,32,64] [--seconds 3] [--protocol frames|http]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from numaserve.client import AsyncFrameClient  # noqa: E402

CONFIG = """
[server]
graceful_timeout = 5.0
[admission]
enabled = false
[env]
vars = {{ NUMASERVE_DEMO_BATCH = "{batch}", NUMASERVE_DEMO_MAX_BATCH = "{max_batch}" }}
[log]
level = "warning"
format = "json"
"""


class Supervisor:
    """`numaserve start` in a subprocess, stopped on exit."""

    def __init__(self, batch: bool, max_batch: int) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="ns-bench-"))
        cfg = self.tmp / "numaserve.toml"
        cfg.write_text(CONFIG.format(batch="1" if batch else "0", max_batch=max_batch))
        self.rt = self.tmp / "rt"
        self.log = open(self.tmp / "stderr", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "numaserve", "start", "--config", str(cfg), "--runtime-dir", str(self.rt),
             "--bind", "127.0.0.1:0", "--nodes", "0", "--workers-per-node", "1"],
            stdout=subprocess.DEVNULL, stderr=self.log, stdin=subprocess.DEVNULL, cwd=str(REPO))
        self.port = self._wait_ready()

    def _wait_ready(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"numaserve start exited: {(self.tmp / 'stderr').read_text()[-2000:]}")
            r = subprocess.run([sys.executable, "-m", "numaserve", "status", "--json", "--runtime-dir", str(self.rt)],
                               capture_output=True, text=True, cwd=str(REPO))
            if r.returncode == 0:
                st = json.loads(r.stdout)
                if st["slots"] and all(s["state"] == "ready" for s in st["slots"]):
                    return int(st["supervisor"]["listeners"][0].rsplit(":", 1)[1])
            time.sleep(0.2)
        raise SystemExit("supervisor not ready in time")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


async def _http_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> int:
    writer.write(b"POST /v1/embeddings HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    await reader.readexactly(length)
    return status


async def drive(port: int, concurrency: int, seconds: float, protocol: str) -> dict[str, Any]:
    """``concurrency`` requests always in flight for ``seconds``; returns rps and latencies."""
    latencies: list[float] = []
    errors = 0
    stop = time.monotonic() + seconds
    conns = max(1, min(concurrency, 8))

    async def frames_worker(client: AsyncFrameClient, k: int) -> None:
        nonlocal errors
        i = 0
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            r = await client.request("POST", "/v1/embeddings", body={"input": f"bench text {k} {i % 50}"})
            i += 1
            if r.status == 200:
                latencies.append(time.perf_counter() - t0)
            else:
                errors += 1

    async def http_worker(k: int) -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = 0
        try:
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                body = json.dumps({"input": f"bench text {k} {i % 50}"}).encode()
                status = await _http_request(reader, writer, body)
                i += 1
                if status == 200:
                    latencies.append(time.perf_counter() - t0)
                else:
                    errors += 1
        finally:
            writer.close()

    t_start = time.monotonic()
    if protocol == "frames":
        clients = [AsyncFrameClient("127.0.0.1", port) for _ in range(conns)]
        for c in clients:
            await c.connect()
        await asyncio.gather(*(frames_worker(clients[k % conns], k) for k in range(concurrency)))
        for c in clients:
            await c.close()
    else:
        await asyncio.gather(*(http_worker(k) for k in range(concurrency)))
    elapsed = time.monotonic() - t_start
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else 0.0

    return {"rps": len(latencies) / elapsed, "p50": pct(0.5), "p99": pct(0.99), "errors": errors}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--levels", default="1,8,32,64", help="comma-separated concurrency levels")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds per level (bounded run)")
    ap.add_argument("--protocol", choices=("frames", "http"), default="frames")
    ap.add_argument("--max-batch", type=int, default=32)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for mode in ("unbatched", "batched"):
        sup = Supervisor(batch=mode == "batched", max_batch=args.max_batch)
        try:
            asyncio.run(drive(sup.port, 4, 1.0, args.protocol))  # warm-up (weights, BLAS, caches)
            results[mode] = {c: asyncio.run(drive(sup.port, c, args.seconds, args.protocol)) for c in levels}
        finally:
            sup.close()
    print(f"demo /v1/embeddings, 1 worker, {os.cpu_count()} CPUs, {args.protocol}, {args.seconds:g} s per level, "
          f"max_batch {args.max_batch}, window 5 ms")
    print(f"{'conc':>5} | {'unbatched rps':>13} {'p50 ms':>7} {'p99 ms':>7} | {'batched rps':>11} {'p50 ms':>7} "
          f"{'p99 ms':>7} | {'speedup':>7}")
    for c in levels:
        u, b = results["unbatched"][c], results["batched"][c]
        speed = b["rps"] / u["rps"] if u["rps"] else float("nan")
        print(f"{c:>5} | {u['rps']:>13.0f} {u['p50']:>7.2f} {u['p99']:>7.2f} | {b['rps']:>11.0f} {b['p50']:>7.2f} "
              f"{b['p99']:>7.2f} | {speed:>6.2f}x" + (f"  (errors {u['errors']}/{b['errors']})"
                                                     if u["errors"] or b["errors"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
