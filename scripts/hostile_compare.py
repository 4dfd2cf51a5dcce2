#!/usr/bin/env python3
"""Hostile HTTP and frame inputs against numaserve and uvicorn serving the same app (issue 34).

    scripts/hostile_compare.py                       # every case, both servers: a markdown table
    scripts/hostile_compare.py --cases deep-json,tls-hello --servers numaserve
    scripts/hostile_compare.py --baseline /path/to/older/checkout   # adds "numaserve-base"

Each server runs one worker on 127.0.0.1 with ``scripts/bench_apps/hostileapp.py``
(numaserve's demo app plus ``/stream`` and ``/sleep``): numaserve with its
defaults except ``server.read_timeout = 5`` (so the timer case ends in
seconds), uvicorn with its own.  Every case sends the same bytes to both and
reports what the client got (``answer``), how the connection ended (``state``:
``closed`` = FIN, ``reset``, ``open`` = still open when the case gave up
waiting), the worker's peak RSS growth during the case (``/proc/PID/status``)
and whether the server's log gained a traceback.
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(1, str(HERE))

from benchlib.servers import NUMASERVE_BASE_TOML, Server, ServerConfig  # noqa: E402

from numaserve.framing import FrameDecoder, decode_response, encode_frame, encode_request  # noqa: E402

MIB = 1 << 20
STATUS = re.compile(rb"HTTP/1\.[01] (\d{3})")


@dataclass
class Result:
    answer: str
    state: str
    rss_mib: float = 0.0
    traceback: bool = False


# --- the client side ------------------------------------------------------------------------------

def converse(port: int, parts: list[bytes], *, wait: float = 5.0, pause: float = 0.2,
             done: Callable[[bytes], bool] | None = None) -> tuple[bytes, str]:
    """Send ``parts`` (``pause`` apart, from a thread: the server may stop reading), read until
    EOF, a reset, ``done(data)`` or ``wait`` seconds of silence: (bytes read, state)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(wait)

    def sender() -> None:
        for i, part in enumerate(parts):
            if i:
                time.sleep(pause)
            try:
                s.sendall(part)
            except OSError:
                return

    t = threading.Thread(target=sender, daemon=True)
    t.start()
    data = b""
    state = "open"
    try:
        while True:
            try:
                chunk = s.recv(4 * MIB)
            except TimeoutError:
                break
            except ConnectionResetError:
                state = "reset"
                break
            if not chunk:
                state = "closed"
                break
            data += chunk
            if done is not None and done(data):
                break
    finally:
        s.close()
    return data, state


def http_answer(data: bytes) -> str:
    codes = [m.decode() for m in STATUS.findall(data)]
    if not codes:
        return "nothing" if not data else f"{len(data)} non-HTTP bytes"
    if len(set(codes)) == 1 and len(codes) > 1:
        return f"{len(codes)} x {codes[0]}"
    return ", ".join(codes)


def frame_answer(data: bytes) -> str:
    if data.startswith(b"HTTP/"):
        return http_answer(data)
    try:
        replies = FrameDecoder(64 * MIB).feed(data)
    except Exception:   # noqa: BLE001 - report what came back, whatever it is
        return f"{len(data)} unparsable bytes"
    if not replies:
        return "nothing" if not data else f"{len(data)} bytes, no whole frame"
    statuses = [str(decode_response(r).get("status")) for r in replies]
    return f"{len(statuses)} frame(s): " + (statuses[0] if len(set(statuses)) == 1 else ",".join(statuses))


def frames_done(n: int) -> Callable[[bytes], bool]:
    def done(data: bytes) -> bool:
        count, i = 0, 0
        while len(data) - i >= 4:
            size = int.from_bytes(data[i:i + 4], "big")
            if len(data) - i - 4 < size:
                break
            i += 4 + size
            count += 1
        return count >= n or data.startswith(b"HTTP/")
    return done


# --- the cases ------------------------------------------------------------------------------------

CHUNKED = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
TLS_HELLO = bytes.fromhex("16030100a5010000a10303") + bytes(32) + bytes.fromhex("000004c02bc02f0100")


def one(parts: list[bytes], **kw: object) -> Callable[[int], tuple[str, str]]:
    def case(port: int) -> tuple[str, str]:
        data, state = converse(port, parts, **kw)  # type: ignore[arg-type]
        return http_answer(data), state
    return case


def pipelined_5000(port: int) -> tuple[str, str]:
    raw = b"".join(b"GET /healthz?%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(5000))
    data, state = converse(port, [raw], done=lambda d: d.count(b"HTTP/1.1 ") >= 5000)
    return http_answer(data), state


def frame_prefix_x100(port: int) -> tuple[str, str]:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    for s in socks:
        s.sendall(MIB.to_bytes(4, "big") + b"{")
    time.sleep(0.3)
    for s in socks:
        s.sendall(b'"')
    time.sleep(1.0)
    states = []
    for s in socks:
        s.setblocking(False)
        try:
            states.append("closed" if s.recv(1) == b"" else "data")
        except BlockingIOError:
            states.append("open")
        except OSError:
            states.append("reset")
        s.close()
    return "-", ", ".join(f"{states.count(k)} {k}" for k in sorted(set(states)))


def frame_fetch(port: int) -> tuple[str, str]:
    data, state = converse(port, [encode_frame(encode_request(1, "GET", "/stream?64"))], wait=20,
                           done=frames_done(1))
    return frame_answer(data), state


def frames_pipelined(port: int) -> tuple[str, str]:
    body = "b" * (MIB - 200)
    raw = b"".join(encode_frame(encode_request(i, "POST", "/sleep", body=body)) for i in range(64))
    out: list[tuple[bytes, str]] = []
    threads = [threading.Thread(target=lambda: out.append(converse(port, [raw], wait=30, done=frames_done(64))))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return "; ".join(frame_answer(d) for d, _ in out), ", ".join(s for _, s in out)


def two_bad_frames(port: int) -> tuple[str, str]:
    data, state = converse(port, [b"\x00\x00\x00\x02xx\x00\xff\xff\xff"])
    return frame_answer(data), state


def unread_body_then_a_byte(port: int) -> tuple[str, str]:
    head = b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    data, state = converse(port, [head, b"a"], pause=0.5, wait=10)
    return http_answer(data), state + " after 10 s"


CASES: dict[str, Callable[[int], tuple[str, str]]] = {
    "pipelined-5000": pipelined_5000,
    "post-70k+next": one([b"POST /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 70000\r\n\r\n" + b"a" * 70000
                          + b"GET /healthz HTTP/1.1\r\nHo", b"st: x\r\n\r\n"]),
    "chunked-xchunked": one([b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: xchunked\r\n\r\n"
                             b"5\r\nhello\r\n0\r\n\r\n"]),
    "chunk-size-ffff..": one([CHUNKED + b"ffffffffffffffffff\r\nhello\r\n0\r\n\r\n"]),
    "chunk-size-0x5": one([CHUNKED + b"0x5\r\nhello\r\n0\r\n\r\n"]),
    "chunk-too-long": one([CHUNKED + b"3\r\nhello\r\n0\r\n\r\n"]),
    "chunk-bare-LF": one([CHUNKED + b"5\nhello\n0\n\n"]),
    "431-while-sending": one([b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 100_000, b"c" * MIB]),
    "lowercase-get": one([b"get / HTTP/1.1\r\nHost: x\r\n\r\n"]),
    "tls-hello": one([TLS_HELLO]),
    "frame-prefix-x100": frame_prefix_x100,
    "frame-fetch-64MiB": frame_fetch,
    "frames-3x64x1MiB": frames_pipelined,
    "two-bad-frames": two_bad_frames,
    "unread-body+byte": unread_body_then_a_byte,
    "deep-json": one([b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 200000\r\n\r\n" + b"[" * 100_000 + b"]" * 100_000]),
}


# --- measuring ------------------------------------------------------------------------------------

def rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def run_case(srv: Server, case: Callable[[int], tuple[str, str]]) -> Result:
    pids = srv.worker_pids()
    log_before = srv.log.read_bytes().count(b"Traceback") if srv.log.exists() else 0
    base = peak = rss(pids)
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss(pids))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        answer, state = case(srv.port)
    finally:
        stop.set()
        sampler.join()
    time.sleep(0.3)   # let the log catch up
    log_after = srv.log.read_bytes().count(b"Traceback") if srv.log.exists() else 0
    return Result(answer, state, (peak - base) / MIB, log_after > log_before)


def start(kind: str, baseline: str) -> Server:
    base = kind == "numaserve-base"
    cfg = ServerConfig("numaserve" if base else kind, workers=1, app="hostileapp:app", label=kind,
                       checkout=baseline if base else "",
                       numaserve_toml="\n[server]\nread_timeout = 5\n" if kind != "uvicorn" else "")
    srv = Server(cfg).start()
    srv.wait_ready(timeout=120)
    return srv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="numaserve,uvicorn", help="comma-separated: numaserve, uvicorn")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    ap.add_argument("--baseline", default="", help="an older numaserve source tree, run as numaserve-base")
    args = ap.parse_args(argv)
    servers = [s for s in args.servers.split(",") if s]
    if args.baseline and "numaserve-base" not in servers:
        servers.insert(0, "numaserve-base")
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            print(f"hostile_compare: unknown case {c!r} (known: {', '.join(CASES)})", file=sys.stderr)
            return 2
    for s in servers:
        if s not in ("numaserve", "uvicorn", "numaserve-base") or (s == "numaserve-base" and not args.baseline):
            print(f"hostile_compare: unknown server {s!r} (numaserve, uvicorn; numaserve-base with --baseline)",
                  file=sys.stderr)
            return 2
    results: dict[str, dict[str, Result]] = {c: {} for c in cases}
    for kind in servers:
        srv = start(kind, args.baseline)
        try:
            for c in cases:
                results[c][kind] = run_case(srv, CASES[c])
                print(f"  {kind:9s} {c:20s} {results[c][kind]}", file=sys.stderr)
        finally:
            srv.stop()
    head = "| case | " + " | ".join(f"{s}: answer | state | RSS MiB | traceback" for s in servers) + " |"
    print(head)
    print("|" + "---|" * (1 + 4 * len(servers)))
    for c in cases:
        cells = []
        for s in servers:
            r = results[c][s]
            cells += [r.answer, r.state, f"{r.rss_mib:+.1f}", "yes" if r.traceback else "no"]
        print(f"| {c} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
