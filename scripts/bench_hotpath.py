#!/usr/bin/env python3
"""Per-layer CPU cost of the worker's request path, in process, without sockets.

    scripts/bench_hotpath.py                  # table of µs of CPU per request, per layer stack
    scripts/bench_hotpath.py --only numaserve --kinds conn   # a new connection per request only
    scripts/bench_hotpath.py --requests 50000 --json out.json
    scripts/bench_hotpath.py --instructions   # instructions per request under valgrind (callgrind)

Each stack is a real protocol class (uvicorn's httptools protocol, or the one
numaserve's worker assembles) fed keep-alive requests through a fake
transport on a uvloop loop: every request is parsed, run through the ASGI
chain to the bench app (``scripts/bench_apps/benchapp.py``, the same app
``scripts/bench`` serves) and its response is written to the transport.  What
is measured is process CPU time per request, so kernel, load generator and
the other processes on a shared machine are left out: the numbers are the
Python/C work of each layer, and differences between stacks are what each
layer costs.  ``sse`` stacks stream ``--chunks`` chunks per request and
report CPU per chunk.  ``conn`` makes a new protocol object per request (``Connection:
close``; ``connection_made``, the request, ``connection_lost``): what a connection costs the
worker above the kernel's accept and close (locality counting, the HTTP-or-frames test, the
protocol's set-up).

``--instructions`` counts machine instructions instead (``valgrind
--tool=callgrind``; the count does not move with the other work on a shared
machine, CPU time does): each stack runs for 1 000 and for ``--requests``
requests in a child process, and the difference is divided by the extra
requests (warm-up included); SSE streams likewise (``--requests`` / 50).  The
lag probe's timer is off in these children for every stack: under valgrind
the wall clock runs ~50x slower per request, so a timer meant for every few
hundred requests would fire on every one.

Stacks: uvicorn's own protocol (proxy headers on, its default, and off), the
worker numaserve assembles (``numaserve.worker.edge.build_stack``, defaults)
and the same worker with admission off (what the gate costs): the "hot path"
table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(1, str(HERE / "bench_apps"))

REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: bench\r\nAccept: */*\r\n\r\n"
SSE_REQUEST = b"GET /sse HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n"
CLOSE_REQUEST = REQUEST[:-2] + b"Connection: close\r\n\r\n"
KINDS = ("tiny", "sse", "conn")


class FakeTransport(asyncio.Transport):
    """Just enough of a transport: records writes, routes reads to the current protocol."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock
        self.protocol: Any = None
        self.closed = False
        self.writes = 0
        self.done: asyncio.Future[None] | None = None
        self.want = b"0\r\n\r\n"

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "socket":
            return self.sock
        if name == "sockname":
            return ("127.0.0.1", 8000)
        if name == "peername":
            return ("127.0.0.1", 50000)
        return default

    def set_protocol(self, protocol: Any) -> None:
        self.protocol = protocol

    def get_protocol(self) -> Any:
        return self.protocol

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def write(self, data: Any) -> None:
        self.writes += 1
        if self.done is not None and not self.done.done() and bytes(data).endswith(self.want):
            self.done.set_result(None)

    def writelines(self, chunks: Any) -> None:
        for c in chunks:
            self.write(c)

    def feed(self, data: bytes) -> None:
        p = self.protocol
        if isinstance(p, asyncio.BufferedProtocol):
            buf = p.get_buffer(len(data))
            buf[: len(data)] = data
            p.buffer_updated(len(data))
        else:
            p.data_received(data)


async def sse_app_wrap(inner: Any, chunks: int) -> Any:
    """The bench app plus ``/sse``: ``chunks`` small events, chunked encoding."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/sse":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
            for i in range(chunks):
                await send({"type": "http.response.body", "body": b"data: tok %d\n\n" % i, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await inner(scope, receive, send)

    return app


def run_stack(make: Callable[[], tuple[type, Any, Any]], requests: int, request: bytes,
              done_marker: bytes, *, per_connection: bool = False) -> float:
    """CPU seconds for ``requests`` requests through ``make()``'s stack: on one keep-alive
    connection, or (``per_connection``) each on a new protocol object, closed after its answer."""
    import uvloop

    async def main() -> float:
        proto_cls, config, state = make()
        lst = socket.create_server(("127.0.0.1", 0))
        peer = socket.create_connection(lst.getsockname())
        sock, _ = lst.accept()   # a connected TCP socket: what TCP_INFO/SO_INCOMING_CPU read
        lst.close()
        loop = asyncio.get_running_loop()

        def connect() -> FakeTransport:
            t = FakeTransport(sock)
            proto = proto_cls(config=config, server_state=state, app_state={})
            t.protocol = proto
            proto.connection_made(t)
            t.want = done_marker
            return t

        t = connect()

        async def one() -> None:
            nonlocal t
            if per_connection:
                t = connect()
            t.done = loop.create_future()
            t.feed(request)
            await t.done
            if per_connection:
                t.protocol.connection_lost(None)

        for i in range(requests // 10 + 50):  # warm-up
            await one()
        c0 = time.process_time()
        for i in range(requests):
            await one()
        dt = time.process_time() - c0
        sock.close()
        peer.close()
        return dt

    return uvloop.run(main())


def run_kind(make: Callable[[], tuple[type, Any, Any]], kind: str, n: int) -> float:
    """``run_stack`` for one of ``KINDS`` (``n``: requests, or SSE streams)."""
    if kind == "sse":
        return run_stack(make, n, SSE_REQUEST, b"0\r\n\r\n")
    if kind == "conn":
        return run_stack(make, n, CLOSE_REQUEST, b"}", per_connection=True)
    return run_stack(make, n, REQUEST, b"}")


def _uvicorn(app: Any, *, proxy: bool, http: Any = "httptools") -> tuple[type, Any, Any]:
    import uvicorn
    from uvicorn.server import ServerState

    config = uvicorn.Config(app, http=http, proxy_headers=proxy, log_config=None, lifespan="off",
                            server_header=False, date_header=True, access_log=False)
    config.load()
    state = ServerState()
    state.default_headers = [(b"date", b"Tue, 01 Dec 2026 12:00:00 GMT")]
    return config.http_protocol_class, config, state


def stacks(sse_chunks: int) -> dict[str, Callable[[], tuple[type, Any, Any]]]:
    """name -> factory of (protocol class, uvicorn config, server state)."""
    import msgspec
    from benchapp import app as bench_app

    from numaserve.worker.spec import WorkerSpec

    sse = asyncio.run(sse_app_wrap(bench_app, sse_chunks))
    out: dict[str, Callable[[], tuple[type, Any, Any]]] = {
        "uvicorn (proxy headers on, its default)": lambda: _uvicorn(sse, proxy=True),
        "uvicorn, proxy headers off": lambda: _uvicorn(sse, proxy=False),
    }
    try:
        from numaserve.worker.edge import assemble_for_bench
    except ImportError:
        assemble_for_bench = None
    if assemble_for_bench is not None:
        spec = WorkerSpec(slot=0, node=0, generation=1, cpus=[0], node_cpus=[0, 1], mempolicy="local",
                          memory_nodes=[0], fd=-1, control="inproc://x")
        out["numaserve worker (edge assembly, defaults)"] = lambda: assemble_for_bench(spec, sse)
        from numaserve.loops.admission import AdmissionSettings

        off = msgspec.structs.replace(spec, admission=AdmissionSettings(enabled=False))
        # what the admission gate costs: the same worker with it off (an A/B, not a configuration to run)
        out["numaserve worker, [admission] enabled = false"] = lambda: assemble_for_bench(off, sse)
    return out


def _no_probe_timer() -> None:
    """For the valgrind children: no lag-probe timer, and a probe that always looks fresh."""
    from numaserve.worker import shedding

    shedding.LoopProbe._arm = lambda self, now: None  # type: ignore[method-assign]
    shedding.LoopProbe.beat = property(lambda s: time.monotonic(), lambda s, v: None)  # type: ignore[assignment]


def _child(name: str, kind: str, n: int, chunks: int) -> None:
    _no_probe_timer()
    run_kind(stacks(chunks)[name], kind, n)


def instructions(name: str, kind: str, n1: int, n2: int, chunks: int) -> float:
    """Instructions per request (per SSE stream) of one stack: two callgrind runs, differenced."""
    import re
    import subprocess

    def total(n: int) -> int:
        argv = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
                str(Path(__file__).resolve()), "--child", name, kind, str(n), "--chunks", str(chunks)]
        err = subprocess.run(argv, capture_output=True, text=True, check=True).stderr
        m = re.search(r"Collected : (\d+)", err)
        if not m:
            raise RuntimeError(f"no instruction count from valgrind: {err[-300:]}")
        return int(m.group(1))

    def with_warmup(n: int) -> int:   # run_stack's warm-up requests are counted too
        return n + n // 10 + 50

    return (total(n2) - total(n1)) / (with_warmup(n2) - with_warmup(n1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench_hotpath.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=None,
                    help="requests per stack (default 20000; with --instructions 6000)")
    ap.add_argument("--chunks", type=int, default=50, help="SSE chunks per streamed request")
    ap.add_argument("--reps", type=int, default=3, help="best of N (CPU time is noisy on a shared machine)")
    ap.add_argument("--only", default="", help="substring filter on stack names")
    ap.add_argument("--kinds", default=",".join(KINDS),
                    help="which of tiny (keep-alive), sse, conn (a new connection per request) to run")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--instructions", action="store_true",
                    help="instructions per request under valgrind instead of CPU time (slow: minutes)")
    ap.add_argument("--child", nargs=3, metavar=("STACK", "KIND", "N"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(a.child[0], a.child[1], int(a.child[2]), a.chunks)
        return 0
    rows = []
    kinds = [k for k in a.kinds.split(",") if k]
    bad = sorted(set(kinds) - set(KINDS))
    if bad:
        ap.error(f"--kinds: unknown {', '.join(bad)} (choose from {', '.join(KINDS)})")
    if not a.instructions and a.requests is None:
        a.requests = 20000
    if a.instructions:
        n2 = max(a.requests or 6000, 1100)
        for name in stacks(a.chunks):
            if a.only and a.only not in name:
                continue
            row = {"stack": name, "chunks": a.chunks}
            if "tiny" in kinds:
                row["tiny_instructions_per_req"] = round(instructions(name, "tiny", 1000, n2, a.chunks))
            if "sse" in kinds:
                row["sse_instructions_per_stream"] = round(
                    instructions(name, "sse", 40, max(80, n2 // a.chunks), a.chunks))
            if "conn" in kinds:
                row["conn_instructions_per_req"] = round(instructions(name, "conn", 1000, n2, a.chunks))
            rows.append(row)
            print("  ".join(f"{v:>10} {k.replace('_instructions', '')}" for k, v in row.items()
                            if k.endswith(("_req", "_stream"))) + f"  {name}", flush=True)
        if a.json:
            a.json.write_text(json.dumps({"requests": n2, "chunks": a.chunks, "rows": rows}, indent=1))
        return 0
    for name, make in stacks(a.chunks).items():
        if a.only and a.only not in name:
            continue
        row = {"stack": name}
        n_sse = max(1, a.requests // a.chunks)
        for kind in kinds:
            n = n_sse if kind == "sse" else a.requests
            best = min(run_kind(make, kind, n) for _ in range(a.reps))
            key = "sse_us_per_chunk" if kind == "sse" else f"{kind}_us_per_req"
            row[key] = round(best / (n * (a.chunks if kind == "sse" else 1)) * 1e6, 2)
        rows.append(row)
        print("  ".join(f"{v:8.2f} {k.replace('_us', ' µs')}" for k, v in row.items() if k != "stack")
              + f"  {name}", flush=True)
    if a.json:
        a.json.write_text(json.dumps({"requests": a.requests, "chunks": a.chunks, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
