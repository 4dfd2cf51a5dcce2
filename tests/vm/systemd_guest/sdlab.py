"""Helpers of the guest systemd tests: systemctl/journalctl, the ops CLI, HTTP load, timings.

Times are CLOCK_MONOTONIC seconds (``time.monotonic()``), the clock of
journald's ``__MONOTONIC_TIMESTAMP`` and of systemd's ``*TimestampMonotonic``
properties, so test-side, journal and unit timestamps compare directly.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

UNIT = "numaserve.service"
PREFIX = Path("/opt/numaserve")            # the venv numaserve is installed in
DEPS = Path("/opt/numaserve-deps")         # its dependencies (the host's, read-only)
NUMASERVE = str(PREFIX / "bin" / "numaserve")
CONFIG = Path("/etc/numaserve/numaserve.toml")
DROPINS = Path("/etc/systemd/system/numaserve.service.d")
APP_DIR = Path("/srv/numaserve-app")
RUNTIME = "/run/numaserve"
PORT = 8000
ADMIN_PORT = 9180


def run(cmd: list[str], *, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} -> rc {p.returncode}\nstdout: {p.stdout[-3000:]}\n"
                             f"stderr: {p.stderr[-3000:]}")
    return p


def systemctl(*args: str, check: bool = True, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return run(["systemctl", *args], check=check, timeout=timeout)


def show(*props: str, unit: str = UNIT) -> dict[str, str]:
    out = systemctl("show", "-p", ",".join(props), unit).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def mono() -> float:
    return time.monotonic()


def ts(entry: dict[str, Any]) -> float:
    """A journal entry's CLOCK_MONOTONIC time in seconds."""
    return int(entry["__MONOTONIC_TIMESTAMP"]) / 1e6


def field_text(v: Any) -> str:
    if isinstance(v, list) and v and isinstance(v[0], int):  # binary field: a byte array
        return bytes(v).decode("utf-8", "replace")
    if isinstance(v, list):
        return "\n".join(field_text(x) for x in v)
    return "" if v is None else str(v)


def journal(*, since: float | None = None, unit: str = UNIT) -> list[dict[str, Any]]:
    """Every journal entry of the unit this boot (its processes' and PID 1's about it)."""
    out = run(["journalctl", "-b", "-u", unit, "-o", "json", "--no-pager", "--all"], timeout=120).stdout
    entries = [json.loads(line) for line in out.splitlines() if line.strip()]
    if since is not None:
        entries = [e for e in entries if ts(e) >= since]
    return entries


def messages(entries: list[dict[str, Any]]) -> list[tuple[float, str]]:
    return [(ts(e), field_text(e.get("MESSAGE"))) for e in entries]


def pid1_lines(entries: list[dict[str, Any]], needle: str) -> list[tuple[float, str]]:
    return [(t, m) for (t, m), e in zip(messages(entries), entries) if e.get("_PID") == "1" and needle in m]


def events(entries: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in entries if e.get("EVENT") == name]


def wait_for(what: str, fn: Callable[[], Any], timeout: float = 180.0, step: float = 0.5) -> Any:
    """Poll ``fn`` until it returns something truthy; fail naming the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})"[:4000])


def ns(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The installed numaserve (as root: the operator's view of /run/numaserve)."""
    return run([NUMASERVE, *args], check=check, timeout=timeout)


def status_cli() -> dict[str, Any]:
    """``numaserve status --json``, the operator's command (a new Python process: 4-10 s under TCG)."""
    return json.loads(ns("status", "--json", "--runtime-dir", RUNTIME).stdout)


def status() -> dict[str, Any]:
    """What ``status --json`` prints, asked over the ops socket from this process (the tests poll
    it; a CLI process per poll cost the guest minutes of emulated CPU)."""
    return _ops("status")


def operations() -> list[dict[str, Any]]:
    return _ops("operation")["operations"]


def _ops(verb: str) -> Any:
    from numaserve.control.client import OpsError, ops_call

    try:
        return ops_call(Path(RUNTIME), verb, timeout=30.0)
    except OpsError as e:
        raise AssertionError(f"ops {verb}: {e}") from None


def http_get(path: str = "/", *, port: int = PORT, timeout: float = 60) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path, headers={"Connection": "close"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def proc_status(pid: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return False


def unit_pids() -> set[int]:
    """Every process in the unit's cgroup."""
    path = Path("/sys/fs/cgroup/system.slice") / UNIT / "cgroup.procs"
    try:
        return {int(x) for x in path.read_text().split()}
    except OSError:
        return set()


@dataclass
class Outcome:
    t0: float
    t1: float
    status: int | None = None
    error: str | None = None
    pid: int | None = None
    shed: bool = False          # admission's 503 + Retry-After "overloaded": an answer, not a lost request


@dataclass
class Load:
    """Clients in threads, each on a keep-alive connection (reconnecting on ``Connection:
    close``); every request's outcome with its start and end time."""

    threads: int = 4
    path: str = "/"
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _workers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> "Load":
        for _ in range(self.threads):
            t = threading.Thread(target=self._run, daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def _run(self) -> None:
        conn: http.client.HTTPConnection | None = None
        while not self._stop.is_set():
            o = Outcome(mono(), 0.0)
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", PORT, timeout=120)
                conn.request("GET", self.path)
                r = conn.getresponse()
                body = r.read()
                o.status = r.status
                try:
                    doc = json.loads(body)
                    o.pid = doc.get("pid")
                    o.shed = (r.status == 503 and r.getheader("retry-after") is not None
                              and (doc.get("error") or {}).get("type") == "overloaded")
                except (ValueError, AttributeError):
                    pass
                if (r.getheader("connection") or "").lower() == "close":
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException) as e:
                o.error = f"{type(e).__name__}: {e}"
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.05)
            o.t1 = mono()
            with self._lock:
                self.outcomes.append(o)
        if conn is not None:
            conn.close()

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for t in self._workers:
            t.join(180)
        return self.outcomes

    def ok(self) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.status == 200]

    def failed(self) -> list[Outcome]:
        with self._lock:
            return [o for o in self.outcomes if o.status != 200 and not o.shed]

    def shed(self) -> list[Outcome]:
        """Refused by admission (the CPU was short: under TCG a booting worker starves the
        node's vCPUs), with Retry-After: the client was told to come back, nothing was lost."""
        with self._lock:
            return [o for o in self.outcomes if o.shed]


def fire(paths: list[str], *, timeout: float = 180) -> tuple[list[Outcome], list[threading.Thread]]:
    """One new connection per path, each in its own thread (requests in flight together)."""
    out: list[Outcome] = []

    def one(path: str) -> None:
        o = Outcome(mono(), 0.0)
        try:
            o.status, body = http_get(path, timeout=timeout)
            o.pid = json.loads(body).get("pid")
        except (OSError, http.client.HTTPException, ValueError) as e:
            o.error = f"{type(e).__name__}: {e}"
        o.t1 = mono()
        out.append(o)

    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in paths]
    for t in threads:
        t.start()
    return out, threads


def listening(port: int = PORT) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def record(name: str, value: Any) -> None:
    """A measurement for the host (and the README): share/timings.json."""
    share = os.environ.get("NUMASERVE_SD_SHARE")
    if not share:
        return
    path = Path(share) / "timings.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[name] = value
    path.write_text(json.dumps(data, indent=1, sort_keys=True))
