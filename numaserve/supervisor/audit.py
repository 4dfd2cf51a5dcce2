"""Audit trail of mutating ops commands: who asked what, and how it ended.

One JSON object per line, appended with O_APPEND (each record is one write,
so concurrent writers never interleave), created 0600.  Every record also
goes to the structured log, so journald keeps it even if the file is lost.
A write that fails is counted and shown in ``numaserve status``
(``supervisor.control_plane.audit``): an operator must be able to tell that
the trail has a hole.  ``who`` holds what the kernel (SO_PEERCRED) or CURVE
verified about the requester, and the client's own claim under ``claimed``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("numaserve.audit")


class AuditLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.errors = 0
        self.written = 0
        self.last_error: str | None = None

    def record(self, *, who: dict[str, Any], channel: str, verb: str, args: dict[str, Any], op_id: str,
               ok: bool, result: str) -> None:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}Z",
            "who": who,
            "channel": channel,
            "verb": verb,
            "args": args,
            "id": op_id,
            "ok": ok,
            "result": result,
        }
        log.info("audit", **entry)
        try:
            text = json.dumps(entry, sort_keys=True, default=str)
        except (TypeError, ValueError):  # odd keys in client-supplied args: keep the record, not the shape
            text = json.dumps({**entry, "args": repr(args)[:2000]}, sort_keys=True, default=str)
        line = (text + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
            self.written += 1
        except OSError as e:
            self.errors += 1
            self.last_error = f"{self.path}: {e.strerror}"
            log.error("audit_write_failed", path=str(self.path), error=e.strerror, failures=self.errors)

    def status(self) -> dict[str, Any]:
        return {"path": str(self.path), "written": self.written, "write_failures": self.errors,
                "last_error": self.last_error}
