"""A bounded load loop on loopback: keep-alive and new-connection clients that
record every failure (exception or non-2xx) and which worker answered."""

from __future__ import annotations

import collections
import http.client
import json
import threading
import time
from dataclasses import dataclass, field


@dataclass
class LoadResult:
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    pids: collections.Counter[int] = field(default_factory=collections.Counter)
    reconnects: int = 0


class LoadLoop:
    """``keepalive`` threads reuse connections (reconnecting on ``Connection:
    close``); ``fresh`` threads open a new connection per request.  Stops at
    ``max_seconds`` or ``max_requests`` per thread, whichever comes first."""

    def __init__(self, port: int, *, keepalive: int = 3, fresh: int = 3, path: str = "/",
                 max_seconds: float = 60.0, max_requests: int = 20000, timeout: float = 15.0,
                 pace: float = 0.0) -> None:
        self.port, self.path, self.timeout, self.pace = port, path, timeout, pace
        self.max_seconds, self.max_requests = max_seconds, max_requests
        self.result = LoadResult()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._keepalive, daemon=True) for _ in range(keepalive)]
        self._threads += [threading.Thread(target=self._fresh, daemon=True) for _ in range(fresh)]

    def __enter__(self) -> "LoadLoop":
        self._t0 = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> LoadResult:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 5)
        return self.result

    def _done(self, n: int) -> bool:
        if self.pace and n:
            self._stop.wait(self.pace)
        return self._stop.is_set() or n >= self.max_requests or time.monotonic() - self._t0 > self.max_seconds

    def _record(self, status: int | None, body: bytes, err: str | None) -> None:
        with self._lock:
            if err is not None:
                self.result.failures.append(err)
            elif status is None or not 200 <= status < 300:
                self.result.failures.append(f"status {status}: {body[:80]!r}")
            else:
                self.result.ok += 1
                try:
                    self.result.pids[json.loads(body).get("pid", 0)] += 1
                except ValueError:
                    pass

    def _keepalive(self) -> None:
        n = 0
        conn: http.client.HTTPConnection | None = None
        while not self._done(n):
            n += 1
            if conn is None:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
                with self._lock:
                    self.result.reconnects += 1
            try:
                conn.request("GET", self.path)
                r = conn.getresponse()
                body = r.read()
                self._record(r.status, body, None)
                if (r.getheader("connection") or "").lower() == "close":
                    conn.close()
                    conn = None
            except Exception as e:  # every failure is recorded, none hidden
                self._record(None, b"", f"keepalive: {type(e).__name__}: {e}")
                conn.close()
                conn = None
        if conn is not None:
            conn.close()

    def _fresh(self) -> None:
        n = 0
        while not self._done(n):
            n += 1
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            try:
                conn.request("GET", self.path, headers={"Connection": "close"})
                r = conn.getresponse()
                self._record(r.status, r.read(), None)
            except Exception as e:
                self._record(None, b"", f"fresh: {type(e).__name__}: {e}")
            finally:
                conn.close()
