"""The GIL-keeping socket calls the sentinel answers 503s with: results, errors, never blocking."""

from __future__ import annotations

import socket

import pytest

from numaserve.net import heldsock

pytestmark = pytest.mark.skipif(not heldsock.AVAILABLE, reason="needs Linux libc")


def test_accept_peek_answer_and_close_a_queued_connection() -> None:
    with socket.create_server(("127.0.0.1", 0)) as lst:
        lst.setblocking(False)
        assert heldsock.accept(lst.fileno()) == -heldsock.EAGAIN   # nothing queued: no wait
        cli = socket.create_connection(lst.getsockname())
        fd = -1
        for _ in range(100):
            fd = heldsock.accept(lst.fileno())
            if fd >= 0:
                break
        assert fd >= 0
        assert heldsock.recv(fd, peek=True) == (-heldsock.EAGAIN, b"")   # head not sent yet
        cli.sendall(b"GET / HTTP/1.1\r\n\r\n")
        cli.settimeout(5)
        n, first = heldsock.recv(fd, peek=True)
        while n == -heldsock.EAGAIN:
            n, first = heldsock.recv(fd, peek=True)
        assert (n, first) == (1, b"G")
        assert heldsock.recv(fd)[0] == len(b"GET / HTTP/1.1\r\n\r\n")
        assert heldsock.send(fd, b"HTTP/1.1 503 x\r\n\r\n") == 18
        assert heldsock.shutdown_wr(fd) == 0
        assert cli.recv(100) == b"HTTP/1.1 503 x\r\n\r\n"
        assert cli.recv(100) == b""          # FIN after the answer
        cli.close()
        n = -heldsock.EAGAIN
        while n == -heldsock.EAGAIN:
            n, _ = heldsock.recv(fd)
        assert n == 0                        # the peer's close reads as EOF
        assert heldsock.close(fd) == 0
        assert heldsock.close(fd) < 0        # a bad fd is -errno, not an exception


def test_send_to_a_reset_peer_is_an_error_code_not_sigpipe() -> None:
    a, b = socket.socketpair()
    b.close()
    assert heldsock.send(a.fileno(), b"x") < 0
    a.close()
