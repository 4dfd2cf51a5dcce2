"""journald's native protocol: numaserve's log records with their fields as journal fields.

Under systemd, stderr is a stream socket to journald, which stores each line as
one opaque ``MESSAGE``.  When ``$JOURNAL_STREAM`` names the stream our stderr is
(systemd.exec(5)), records go to ``/run/systemd/journal/socket`` instead, one
datagram each (systemd's ``sd_journal_send`` format): ``MESSAGE`` is the same
line stderr would have carried (so ``journalctl -o cat | jq`` keeps working),
every structured key becomes a field (``EVENT=``, ``SLOT=``, ``REASON=`` ...)
and the level becomes ``PRIORITY``, so ``journalctl -u numaserve EVENT=crash
SLOT=1`` and ``journalctl -p err`` work.  Anything that cannot be sent
(socket gone, journald restarting) falls back to the stream.

The encoding is pure (``field_name``, ``encode``, ``record_fields``); the
socket is behind ``JournalSender``.
"""

from __future__ import annotations

import array
import errno
import fcntl
import json
import logging
import os
import re
import socket
import struct
import threading
from typing import Any, Mapping, TextIO

__all__ = [
    "JOURNAL_SOCKET", "JournalHandler", "JournalSender", "encode", "field_name", "journal_handler",
    "priority", "record_fields", "stash_event", "stream_is_journal",
]

JOURNAL_SOCKET = "/run/systemd/journal/socket"
IDENTIFIER = "numaserve"
_PREFIX = "NUMASERVE_"
# Fields journald or journalctl give a meaning of their own; a log key with one of
# these names is stored as NUMASERVE_<NAME> instead of overriding it.
_RESERVED = frozenset({
    "MESSAGE", "MESSAGE_ID", "PRIORITY", "CODE_FILE", "CODE_LINE", "CODE_FUNC", "ERRNO", "TID",
    "INVOCATION_ID", "USER_INVOCATION_ID", "SYSLOG_FACILITY", "SYSLOG_IDENTIFIER", "SYSLOG_PID",
    "SYSLOG_TIMESTAMP", "SYSLOG_RAW", "DOCUMENTATION", "UNIT", "USER_UNIT",
})
_RESERVED_PREFIXES = ("OBJECT_", "COREDUMP_")
_BAD = re.compile(r"[^A-Z0-9_]")
_MAX_NAME = 64


def stream_is_journal(stream: Any, environ: Mapping[str, str] | None = None) -> bool:
    """True when ``stream`` is the journal stream systemd connected (``$JOURNAL_STREAM=dev:ino``)."""
    env = os.environ if environ is None else environ
    dev, _, ino = env.get("JOURNAL_STREAM", "").partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, ValueError, OSError):
        return False
    return st.st_dev == int(dev) and st.st_ino == int(ino)


def field_name(key: str) -> str:
    """Journal field name for a log key: ``slot`` -> ``SLOT``, ``exit-code`` -> ``EXIT_CODE``.

    Names are upper-case ``[A-Z0-9_]``, start with a letter and are at most 64
    bytes; keys that would clash with journald's own fields get ``NUMASERVE_``.
    """
    name = _BAD.sub("_", key.upper())
    if not name[:1].isalpha() or name in _RESERVED or name.startswith(_RESERVED_PREFIXES):
        name = _PREFIX + name.lstrip("_")
    return name[:_MAX_NAME].rstrip("_") or _PREFIX.rstrip("_")


def _value(v: Any) -> bytes:
    if isinstance(v, bytes):
        return v
    if isinstance(v, str):
        return v.encode("utf-8", "replace")
    return json.dumps(v, default=str, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "replace")


def encode(fields: list[tuple[str, Any]]) -> bytes:
    """One native-protocol datagram: ``NAME=value\\n``, or for values with a newline
    ``NAME\\n`` + 64-bit little-endian length + value + ``\\n``."""
    out = bytearray()
    for name, v in fields:
        data = _value(v)
        if b"\n" in data:
            out += name.encode() + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += name.encode() + b"=" + data + b"\n"
    return bytes(out)


def priority(levelno: int) -> int:
    """syslog priority (journalctl -p) of a logging level."""
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


def record_fields(event: Mapping[str, Any], message: str, prio: int) -> list[tuple[str, Any]]:
    """The journal entry of one record: MESSAGE, PRIORITY, SYSLOG_IDENTIFIER, then every key."""
    fields: list[tuple[str, Any]] = [("MESSAGE", message), ("PRIORITY", str(prio)),
                                     ("SYSLOG_IDENTIFIER", IDENTIFIER)]
    seen = {n for n, _ in fields}
    for key, v in event.items():
        if not isinstance(key, str) or not key or key.startswith("_"):
            continue  # structlog/stdlib bookkeeping (_record, _from_structlog)
        name = field_name(key)
        if name in seen:
            continue
        seen.add(name)
        fields.append((name, v))
    return fields


class JournalSender:
    """Sends datagrams to journald; large ones as a sealed memfd (as libsystemd does)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or JOURNAL_SOCKET
        self._sock: socket.socket | None = None

    def send(self, payload: bytes) -> bool:
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, self.path)
            return True
        except OSError as e:
            if e.errno in (errno.EMSGSIZE, errno.ENOBUFS) and self._sock is not None:
                return self._send_memfd(payload)
            return False

    def _send_memfd(self, payload: bytes) -> bool:
        assert self._sock is not None
        try:
            fd = os.memfd_create("numaserve-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except (AttributeError, OSError):
            return False
        try:
            os.write(fd, payload)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,  # journald accepts only sealed memfds
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
            self._sock.sendmsg([], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))], 0,
                               self.path)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


# The processed event of the record being formatted in this thread (ProcessorFormatter
# formats a copy of the record, so the event cannot travel on the record itself).
_formatted = threading.local()


def stash_event(_logger: Any, _name: str, event_dict: Any) -> Any:
    """ProcessorFormatter step: keep the fully processed event (stdlib records too,
    with pid, process and the context) for the JournalHandler."""
    _formatted.event = {k: v for k, v in event_dict.items() if not k.startswith("_")}
    return event_dict


def _event_of(record: logging.LogRecord) -> dict[str, Any]:
    if isinstance(record.msg, dict):  # a structlog event (ProcessorFormatter leaves it in msg)
        return record.msg
    return {"event": record.getMessage(), "level": record.levelname.lower(), "logger": record.name}


class JournalHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Formats like a StreamHandler, sends to journald with fields, writes to the stream if that fails."""

    def __init__(self, stream: TextIO, sender: JournalSender | None = None) -> None:
        super().__init__(stream)
        self.sender = sender or JournalSender()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            _formatted.event = None
            line = self.format(record)
            event = _formatted.event or _event_of(record)
            payload = encode(record_fields(event, line, priority(record.levelno)))
            if self.sender.send(payload):
                return
            self.stream.write(line + self.terminator)
            self.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)

    def close(self) -> None:
        self.sender.close()
        super().close()


def journal_handler(stream: TextIO, environ: Mapping[str, str] | None = None) -> JournalHandler | None:
    """A JournalHandler when ``stream`` is systemd's journal stream and the socket exists, else None."""
    if not stream_is_journal(stream, environ) or not os.path.exists(JOURNAL_SOCKET):
        return None
    return JournalHandler(stream)
