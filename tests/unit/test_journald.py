"""journald native protocol sink: field names, encoding, detection, the handler (against a
datagram socket standing in for /run/systemd/journal/socket)."""

from __future__ import annotations

import array
import json
import logging
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from numaserve.journald import (
    JournalHandler,
    encode,
    field_name,
    journal_handler,
    priority,
    record_fields,
    stream_is_journal,
)


def decode(data: bytes) -> dict[str, bytes]:
    """The native protocol, parsed the way journald does (both value forms)."""
    out: dict[str, bytes] = {}
    i = 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            k, v = line.split(b"=", 1)
            out[k.decode()] = v
            i = nl + 1
        else:
            (n,) = struct.unpack("<Q", data[nl + 1:nl + 9])
            out[line.decode()] = data[nl + 9:nl + 9 + n]
            assert data[nl + 9 + n:nl + 10 + n] == b"\n"
            i = nl + 10 + n
    return out


class FakeJournal:
    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(5)

    def recv(self) -> dict[str, bytes]:
        msg, anc, _flags, _addr = self.sock.recvmsg(1 << 20, socket.CMSG_SPACE(4))
        if not msg and anc:  # a memfd
            fds = array.array("i")
            fds.frombytes(anc[0][2][:4])
            with os.fdopen(fds[0], "rb") as f:
                f.seek(0)  # the sender's offset: journald mmaps it
                msg = f.read()
        return decode(msg)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture()
def journal(tmp_path: Path):
    j = FakeJournal(tmp_path / "journal.sock")
    yield j
    j.close()


def test_field_names() -> None:
    assert field_name("slot") == "SLOT"
    assert field_name("event") == "EVENT"
    assert field_name("exit-code") == "EXIT_CODE"
    assert field_name("old_pid") == "OLD_PID"
    assert field_name("message") == "NUMASERVE_MESSAGE"      # never overrides journald's own
    assert field_name("priority") == "NUMASERVE_PRIORITY"
    assert field_name("unit") == "NUMASERVE_UNIT"
    assert field_name("object_pid") == "NUMASERVE_OBJECT_PID"
    assert field_name("_secret") == "NUMASERVE_SECRET"       # leading _ = trusted fields
    assert field_name("2xx") == "NUMASERVE_2XX"
    assert field_name("ключ") == "NUMASERVE"
    assert len(field_name("x" * 100)) == 64


def test_encode_both_forms() -> None:
    data = encode([("MESSAGE", "hi"), ("EXCEPTION", "Traceback\n  line"), ("SLOT", 1),
                   ("CPUS", [2, 3]), ("OK", True), ("NONE", None)])
    d = decode(data)
    assert d == {"MESSAGE": b"hi", "EXCEPTION": b"Traceback\n  line", "SLOT": b"1", "CPUS": b"[2,3]",
                 "OK": b"true", "NONE": b"null"}
    assert b"EXCEPTION\n" + struct.pack("<Q", 16) in data


def test_record_fields_and_priority() -> None:
    ev = {"event": "crash", "slot": 1, "reason": "exit 3", "level": "error", "_record": object(),
          "message": "shadowed", "MESSAGE": "dup"}
    f = dict(record_fields(ev, '{"event": "crash"}', priority(logging.ERROR)))
    assert f["MESSAGE"] == '{"event": "crash"}' and f["PRIORITY"] == "3" and f["SYSLOG_IDENTIFIER"] == "numaserve"
    assert f["EVENT"] == "crash" and f["SLOT"] == 1 and f["REASON"] == "exit 3"
    assert f["NUMASERVE_MESSAGE"] == "shadowed" and "_RECORD" not in f and "NUMASERVE_RECORD" not in f
    assert [priority(x) for x in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, logging.CRITICAL)] \
        == [7, 6, 4, 3, 2]


def test_stream_detection(tmp_path: Path) -> None:
    p = tmp_path / "stream"
    with open(p, "w") as f:
        st = os.fstat(f.fileno())
        assert stream_is_journal(f, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
        assert not stream_is_journal(f, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"})
        assert not stream_is_journal(f, {"JOURNAL_STREAM": "garbage"})
        assert not stream_is_journal(f, {})
        assert journal_handler(f, {}) is None
    assert not stream_is_journal(object(), {"JOURNAL_STREAM": "1:2"})


def test_handler_sends_structlog_and_stdlib_records_with_fields(journal: FakeJournal, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import structlog

    import numaserve.journald as jd
    from numaserve.log import configure_logging, get_logger

    monkeypatch.setattr(jd, "stream_is_journal", lambda stream, environ=None: True)
    monkeypatch.setattr(jd, "JOURNAL_SOCKET", journal.path)
    out = open(tmp_path / "stderr", "w")
    try:
        configure_logging("info", "json", stream=out, process="worker-1")
        mine = [h for h in logging.getLogger().handlers if getattr(h, "_numaserve_handler", False)]
        assert len(mine) == 1 and isinstance(mine[0], JournalHandler)
        structlog.contextvars.bind_contextvars(slot=1, generation=3)
        get_logger("numaserve.test").warning("crash", reason="exit 3", cpus=[2, 3])
        d = journal.recv()
        assert d["EVENT"] == b"crash" and d["SLOT"] == b"1" and d["REASON"] == b"exit 3"
        assert d["CPUS"] == b"[2,3]" and d["PRIORITY"] == b"4" and d["PROCESS"] == b"worker-1"
        assert json.loads(d["MESSAGE"])["event"] == "crash"  # the same JSON line stderr would carry
        # a stdlib record (uvicorn) gets the same context and fields
        logging.getLogger("uvicorn.error").error("boom %s", 7)
        d = journal.recv()
        assert d["EVENT"] == b"boom 7" and d["LOGGER"] == b"uvicorn.error" and d["PRIORITY"] == b"3"
        assert d.get("SLOT") == b"1" and d.get("GENERATION") == b"3" and d.get("PROCESS") == b"worker-1", d
        # large records go as a sealed memfd
        get_logger("numaserve.test").info("big", blob="x" * 400_000)
        d = journal.recv()
        assert d.get("EVENT") == b"big" and len(d.get("BLOB", b"")) == 400_000, sorted(d)
        # journald gone: the line goes to the stream instead
        journal.close()
        os.unlink(journal.path)
        get_logger("numaserve.test").info("fallback", slot=0)
        out.flush()
        assert '"event": "fallback"' in (tmp_path / "stderr").read_text()
    finally:
        structlog.contextvars.clear_contextvars()
        for hd in list(logging.getLogger().handlers):
            if isinstance(hd, JournalHandler):
                logging.getLogger().removeHandler(hd)
                hd.close()
        out.close()
        structlog.reset_defaults()


def test_configure_logging_picks_the_journal_only_for_the_journal_stream(tmp_path: Path) -> None:
    """In a child process: JOURNAL_STREAM matching stderr selects the JournalHandler."""
    code = (
        "import logging, os, sys\n"
        "st = os.fstat(2)\n"
        "os.environ['JOURNAL_STREAM'] = f'{st.st_dev}:{st.st_ino}'\n"
        "import numaserve.journald as j\n"
        "j.JOURNAL_SOCKET = sys.argv[1]\n"
        "from numaserve.log import configure_logging\n"
        "configure_logging('info', 'json')\n"
        "print(type(logging.getLogger().handlers[-1]).__name__)\n"
    )
    sock = tmp_path / "j.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(sock))
    try:
        with open(tmp_path / "err", "w") as err:
            r = subprocess.run([sys.executable, "-c", code, str(sock)], stderr=err, stdout=subprocess.PIPE,
                               text=True, timeout=60, cwd=str(Path(__file__).resolve().parents[2]))
        assert r.stdout.strip() == "JournalHandler", (r.stdout, (tmp_path / "err").read_text())
        r = subprocess.run([sys.executable, "-c", code.replace("st.st_ino}", "st.st_ino + 1}"), str(sock)],
                           capture_output=True, text=True, timeout=60, cwd=str(Path(__file__).resolve().parents[2]))
        assert r.stdout.strip() == "StreamHandler", r
    finally:
        s.close()
