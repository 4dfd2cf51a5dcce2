"""The worker's gate page (one writer, torn reads detected) and the hand-back socket (real fds)."""

from __future__ import annotations

import asyncio
import math
import os
import socket
import stat
from pathlib import Path

import pytest

from numaserve.net.gatepage import PAGE_BYTES, GatePage, create_page
from numaserve.worker.handback import HandBack, handback_path, send_fd


def test_a_stamp_reads_back_and_a_fresh_page_reads_none(tmp_path: Path) -> None:
    p = str(tmp_path / "gate-0.page")
    create_page(p)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600 and os.path.getsize(p) == PAGE_BYTES
    w, r = GatePage(p), GatePage(p)
    assert r.read() is None
    w.stamp(42, 43, 1.5, 0.01, 0.25, 3, 1, 0.02, 0.002, -math.inf, True)
    v = r.read()
    assert v is not None and (v.pid, v.tid, v.beat, v.inflight, v.waiting, v.overloaded) == (42, 43, 1.5, 3, 1, True)
    assert v.last_shed < -1e299
    w.stamp(42, 43, 2.5, 0.01, 0.3, 0, 0, 0.02, 0.002, 2.0, False)
    v = r.read()
    assert v is not None and (v.beat, v.inflight, v.last_shed, v.overloaded) == (2.5, 0, 2.0, False)


def test_a_stamp_being_written_is_not_read(tmp_path: Path) -> None:
    p = str(tmp_path / "gate-1.page")
    create_page(p)
    w, r = GatePage(p), GatePage(p)
    w.stamp(42, 43, 1.5, 0.01, 0.25, 3, 1, 0.02, 0.002, 0.0, True)
    import struct
    struct.pack_into("<I", w._map, 0, 3)   # odd sequence: a writer mid-stamp
    assert r.read() is None


def test_a_short_page_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "short.page"
    p.write_bytes(b"\0" * 8)
    with pytest.raises(OSError, match="shorter"):
        GatePage(str(p))


def test_handback_adopts_tcp_connections_and_closes_anything_else(tmp_path: Path) -> None:
    path = handback_path(str(tmp_path / "gate-2.page"))
    assert path.endswith("gate-2.hb")
    adopted: list[socket.socket] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        hb = HandBack(adopted.append)
        assert hb.open(loop, path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        srv = socket.create_server(("127.0.0.1", 0))
        cli = socket.create_connection(srv.getsockname())
        conn, _ = srv.accept()
        r, w = os.pipe()
        send_fd(path, conn.fileno())
        send_fd(path, r)
        conn.close()
        os.close(r)
        for _ in range(100):
            if hb.adopted + hb.refused >= 2:
                break
            await asyncio.sleep(0.01)
        assert (hb.adopted, hb.refused) == (1, 1)
        got = adopted[0]
        cli.sendall(b"ping")
        await asyncio.sleep(0.05)
        assert got.recv(4) == b"ping"     # the very connection the sender accepted
        got.close(); cli.close(); srv.close(); os.close(w)
        hb.close(loop)
        assert not os.path.exists(path)

    asyncio.run(main())


def test_handback_replaces_a_dead_workers_socket_file_and_fails_cleanly_on_a_bad_path(tmp_path: Path) -> None:
    path = str(tmp_path / "gate-3.hb")
    Path(path).write_text("stale")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        hb = HandBack(lambda s: None)
        assert hb.open(loop, path)
        hb.close(loop)
        assert not HandBack(lambda s: None).open(loop, str(tmp_path / ("x" * 200) / "gate.hb"))
        with pytest.raises(OSError):   # nobody bound there: the sender learns it (and closes the connection)
            send_fd(path, 0)

    asyncio.run(main())


def test_the_door_answers_http_with_503_and_hands_silent_or_framed_connections_back(tmp_path: Path) -> None:
    """DoorShedder's per-connection step on real sockets: an HTTP head gets the 503; a frame, or a
    connection that has sent nothing by the head deadline, reaches the worker's hand-back unanswered."""
    import time

    from numaserve.loops.admission import AdmissionSettings
    from numaserve.net import heldsock
    from numaserve.supervisor.doorshed import DoorShedder, DoorTarget

    if not heldsock.AVAILABLE:
        pytest.skip("no libc")
    page_path = str(tmp_path / "gate-0.page")
    create_page(page_path)
    srv = socket.create_server(("127.0.0.1", 0))
    srv.setblocking(False)
    adopted: list[socket.socket] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        hb = HandBack(adopted.append)
        assert hb.open(loop, handback_path(page_path))
        d = DoorShedder(AdmissionSettings())
        d.set_targets({0: DoorTarget(0, os.getpid(), (srv,), GatePage(page_path), lambda: True)})
        http_c = socket.create_connection(srv.getsockname())
        http_c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        frame_c = socket.create_connection(srv.getsockname())
        frame_c.sendall(b"\x00\x00\x00\x02{}")
        silent_c = socket.create_connection(srv.getsockname())
        await asyncio.sleep(0.05)
        for _ in range(3):
            assert d._take(d.targets[0], srv, time.monotonic())
        await asyncio.sleep(0.1)
        d._service(time.monotonic())       # the silent one's deadline has passed: handed back
        for _ in range(100):
            if len(adopted) >= 2:
                break
            await asyncio.sleep(0.01)
        assert d.shed == {0: 1} and d.handed_back == 2 and len(adopted) == 2
        http_c.settimeout(5)
        assert http_c.recv(4096).startswith(b"HTTP/1.1 503")
        def peek(s: socket.socket) -> bytes:
            try:
                return s.recv(6, socket.MSG_PEEK)
            except BlockingIOError:
                return b""      # the silent one: nothing sent, nothing answered

        first = {peek(s) for s in adopted}
        assert first == {b"\x00\x00\x00\x02{}", b""}
        assert b"\x00\x00\x00\x02{}" in first       # the frame reached the worker untouched
        for s in (http_c, frame_c, silent_c, *adopted):
            s.close()
        d._service(time.monotonic() + 5)   # lingering fds closed
        hb.close(loop)

    asyncio.run(main())
    srv.close()
