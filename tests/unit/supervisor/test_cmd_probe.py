"""[cmd] readiness: parsing, and the probe on a real reuseport group (this process serves)."""

import asyncio
import os
import select
import socket
import threading

import pytest

from numaserve.errors import UsageError
from numaserve.net.listeners import open_listeners
from numaserve.net.steering import attach_reuseport_cbpf, build_selection_program
from numaserve.cmdready import ReadySpec, host_port_placeholders, parse_ready
from numaserve.supervisor.probe import probe_slot, process_tree
from numaserve.supervisor.rescue import Rescuer
from numaserve.supervisor.spawn import check_cmd_template
from numaserve.supervisor.steer import Steering


def test_parse_ready():
    assert parse_ready("tcp") == ReadySpec("tcp")
    assert parse_ready("alive") == ReadySpec("alive")
    assert parse_ready("http:/healthz") == ReadySpec("http", "/healthz")
    assert parse_ready("http:") == ReadySpec("http", "/")
    for bad in ("http", "http:healthz", "http:/a b", "udp", ""):
        with pytest.raises(ValueError):
            parse_ready(bad)


def test_host_port_placeholders_are_refused_unless_allowed():
    assert host_port_placeholders("srv --host {host} --port {port} --fd {fd}") == ["host", "port"]
    assert host_port_placeholders("uvicorn app:app --fd {fd}") == []
    with pytest.raises(UsageError, match=r"\{port\}.*\{fd\}.*allow_host_port"):
        check_cmd_template("granian --host 0.0.0.0 --port {port} app:app")
    check_cmd_template("granian --port {port} app:app", allow_host_port=True)
    check_cmd_template("uvicorn app:app --fd {fd}")


def test_selection_program_probe_entries_pin_their_source_port():
    prog = build_selection_program(healthy=[0, 1], group_size=2, probes={40000: 1})
    assert prog is not None and (0x15, 0, 1, 40000) in prog and prog[-1][3] == 0xFFFFFFFF
    assert build_selection_program(healthy=[], group_size=2, probes={40000: 0}) is not None
    with pytest.raises(ValueError):
        build_selection_program(healthy=[0], group_size=2, probes={40000: 2})


def _accepting(sock, stop, accepted):
    sock = socket.socket(fileno=os.dup(sock.fileno()))
    while not stop.is_set():
        r, _, _ = select.select([sock], [], [], 0.05)
        if r:
            try:
                c, _ = sock.accept()
                accepted.append(c)
            except BlockingIOError:
                pass
    sock.close()


def test_probe_is_routed_to_its_slot_and_sees_who_accepted():
    ls = open_listeners(["127.0.0.1:0"], [0, 1], 64)
    st = Steering(ls)
    st.update([0])                       # slot 1 unhealthy: no regular traffic goes there
    stop = threading.Event()
    got: list[socket.socket] = []
    t = threading.Thread(target=_accepting, args=(ls.by_slot[1][0].sock, stop, got))
    t.start()
    try:
        res = asyncio.run(probe_slot(st, ls.by_slot[1][0], 1, lambda: process_tree(os.getpid()), ReadySpec("tcp"), 2.0))
        assert res.ok, res.note
        assert f"pid {os.getpid()}" in res.note and len(got) == 1
        assert st.probes == {}           # the probe entry is gone again
        # the accepting process is not the worker's: not ready
        res = asyncio.run(probe_slot(st, ls.by_slot[1][0], 1, lambda: {1}, ReadySpec("tcp"), 1.0))
        assert not res.ok and "not by this worker" in res.note
        # nobody accepts on slot 0's socket
        res = asyncio.run(probe_slot(st, ls.by_slot[0][0], 0, lambda: {os.getpid()}, ReadySpec("tcp"), 0.5))
        assert not res.ok and "not accepted" in res.note
    finally:
        stop.set()
        t.join()
        for c in got:
            c.close()
        ls.close()


def test_http_probe_wants_a_2xx_or_3xx():
    ls = open_listeners(["127.0.0.1:0"], [0], 64)
    st = Steering(ls)
    st.update([0])
    answers = iter([b"HTTP/1.1 503 Service Unavailable\r\n\r\n", b"HTTP/1.1 200 OK\r\n\r\n"])
    stop = threading.Event()

    def serve():
        sock = socket.socket(fileno=os.dup(ls.by_slot[0][0].fd))
        while not stop.is_set():
            r, _, _ = select.select([sock], [], [], 0.05)
            if r:
                try:
                    c, _ = sock.accept()
                except BlockingIOError:
                    continue
                c.setblocking(True)
                c.recv(4096)
                c.sendall(next(answers))
                c.close()
        sock.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        spec = ReadySpec("http", "/healthz")
        r1 = asyncio.run(probe_slot(st, ls.by_slot[0][0], 0, lambda: {os.getpid()}, spec, 2.0))
        r2 = asyncio.run(probe_slot(st, ls.by_slot[0][0], 0, lambda: {os.getpid()}, spec, 2.0))
        assert not r1.ok and "503" in r1.note
        assert r2.ok and "200" in r2.note
    finally:
        stop.set()
        t.join()
        ls.close()


def test_stranded_connections_are_relayed_to_a_serving_slot():
    ls = open_listeners(["127.0.0.1:0"], [0, 1], 64)
    port = ls.by_slot[0][0].port
    st = Steering(ls)
    queued = []
    for _ in range(5):                   # queued on slot 1 before it failed (program: slot 1 only)
        attach_reuseport_cbpf(ls.by_slot[0][0].sock, build_selection_program(healthy=[1], group_size=2))
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(b"ping")
        queued.append(c)
    st.update([0])                       # now only slot 0 serves

    async def main():
        async def echo(r, w):
            data = await r.read(4)
            w.write(b"pong:" + data)
            await w.drain()
            w.close()
        server = await asyncio.start_server(echo, sock=socket.socket(fileno=os.dup(ls.by_slot[0][0].fd)))
        rescuer = Rescuer()
        assert rescuer.tick([(1, ls.by_slot[1][0])]) == 5
        loop = asyncio.get_running_loop()
        outs = []
        for c in queued:
            c.setblocking(False)
            buf = b""
            while not buf.endswith(b"ping"):
                buf += await asyncio.wait_for(loop.sock_recv(c, 100), 5)
            outs.append(buf)
            c.close()
        await rescuer.close()
        server.close()
        return outs, rescuer.status()

    try:
        outs, status = asyncio.run(main())
        assert outs == [b"pong:ping"] * 5
        assert status["rescued"] == 5 and status["relay_failures"] == 0
    finally:
        ls.close()
