"""Probe one slot the way a client would, and see *which process* served it.

The probe connects from a source port it chose; the steering program routes
that port to the probed slot's socket (``Steering.add_probe``), whatever the
slot's health.  The kernel then says who accepted: the server side of the
probe connection gets a socket inode once a process accepts it (0 while it
waits in the queue), and ``/proc/PID/fd`` says which process holds that
inode.  Only the new worker's process tree counts — during a rolling
replacement the old worker accepts from the same socket, and its answer must
not make the new one look ready.

``cmd.ready = "http:/path"`` then sends ``GET /path`` on the accepted
connection and wants a 2xx or 3xx status within ``cmdprobe.PROBE_TIMEOUT`` (2 s).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable

from numaserve.net.listeners import Listener
from numaserve.net.sockdiag import find_connection, socket_inodes_of
from numaserve.cmdready import ReadySpec
from numaserve.supervisor.rescue import connect_address
from numaserve.supervisor.steer import Steering

__all__ = ["ProbeResult", "probe_slot", "process_tree", "holder_of"]

_POLL = 0.02


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    note: str


def process_tree(pid: int, *, proc: str = "/proc") -> set[int]:
    """``pid`` and every descendant (a server command may fork its own workers)."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return {pid}
    for n in names:
        if not n.isdigit():
            continue
        try:
            with open(os.path.join(proc, n, "stat")) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(n))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, ()))
    return out


def holder_of(inode: int, pids: set[int], *, proc: str = "/proc") -> int | None:
    """The process among ``pids`` holding socket ``inode`` open."""
    for pid in sorted(pids):
        if inode in set(socket_inodes_of(pid, proc=proc)):
            return pid
    return None


def _holder_anywhere(inode: int) -> int | None:
    from numaserve.net.portowners import owners

    found = owners([inode]).get(inode, [])
    return found[0].pid if found else None


async def probe_slot(steering: Steering, lst: Listener, slot: int, tree: Callable[[], set[int]],
                     spec: ReadySpec, timeout: float) -> ProbeResult:
    """One probe of ``slot`` through listener ``lst``; ``tree()`` = the worker's processes now."""
    loop = asyncio.get_running_loop()
    host, port = connect_address(lst)
    s = socket.socket(lst.family, socket.SOCK_STREAM)
    s.setblocking(False)
    sport = 0
    deadline = time.monotonic() + timeout
    try:
        s.bind((host, 0))
        sport = s.getsockname()[1]
        steering.add_probe(sport, slot)
        try:
            await asyncio.wait_for(loop.sock_connect(s, (host, port)), timeout)
        except (OSError, asyncio.TimeoutError) as e:
            return ProbeResult(False, f"connect failed: {e or 'timeout'}")
        holder = None
        while time.monotonic() < deadline:
            server_side = find_connection(lst.family, host, port, host, sport)
            if server_side is not None and server_side.inode:
                pids = tree()
                holder = holder_of(server_side.inode, pids)
                if holder is None:
                    other = _holder_anywhere(server_side.inode)
                    return ProbeResult(False, f"accepted by pid {other or '?'}, not by this worker")
                break
            await asyncio.sleep(_POLL)
        if holder is None:
            return ProbeResult(False, f"not accepted within {timeout:g}s")
        if spec.kind != "http":
            return ProbeResult(True, f"accepted by pid {holder}")
        req = (f"GET {spec.path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: numaserve-probe\r\n"
               "Connection: close\r\n\r\n").encode()
        try:
            await asyncio.wait_for(loop.sock_sendall(s, req), max(0.01, deadline - time.monotonic()))
            head = b""
            while b"\r\n" not in head and len(head) < 4096:
                chunk = await asyncio.wait_for(loop.sock_recv(s, 4096), max(0.01, deadline - time.monotonic()))
                if not chunk:
                    break
                head += chunk
        except (OSError, asyncio.TimeoutError) as e:
            return ProbeResult(False, f"GET {spec.path}: no answer ({e or 'timeout'})")
        line = head.split(b"\r\n", 1)[0].decode("latin-1", "replace")
        parts = line.split()
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            return ProbeResult(False, f"GET {spec.path}: not an HTTP answer ({line[:60]!r})")
        status = int(parts[1])
        if 200 <= status < 400:
            return ProbeResult(True, f"GET {spec.path} -> {status} from pid {holder}")
        return ProbeResult(False, f"GET {spec.path} -> {status}")
    finally:
        if sport:
            steering.remove_probe(sport)
        s.close()
