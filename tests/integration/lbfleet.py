"""A small fleet on loopback for the load-balancer tests: numaserve instances on
fixed ports, a real HAProxy (Debian's ``haproxy``) started from the project's
own ``deploy/haproxy/haproxy.cfg``, and a bounded client load that classifies
every failure (503 shed by admission, 502/503/504 from the balancer,
disconnects) so a test can say exactly what went wrong."""

from __future__ import annotations

import collections
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tests.integration.harness import FAST_CONFIG, REPO, Running, free_port

HAPROXY_CFG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
NGINX_CONF = REPO / "deploy" / "nginx" / "numaserve.conf"


def _sbin(name: str) -> str | None:
    return shutil.which(name) or (f"/usr/sbin/{name}" if os.path.exists(f"/usr/sbin/{name}") else None)


HAPROXY = _sbin("haproxy")
NGINX = _sbin("nginx")

# ------------------------------------------------------------------ numaserve


class Instance:
    """One numaserve host of the fleet: fixed serving and admin ports, restartable."""

    def __init__(self, name: str, *, app: str = "lbapp:app", lb_grace: float | None = 2.0, extra_config: str = "",
                 args: tuple[str, ...] = ("--nodes", "0")) -> None:
        self.name = name
        self.port = free_port()
        self.admin_port = free_port()
        self.app = app
        self.args = args
        config = FAST_CONFIG.replace('bind = "127.0.0.1:0"', f'bind = "127.0.0.1:{self.admin_port}"')
        if lb_grace is not None:
            config = _merge_server(config, f"lb_grace = {lb_grace}")
        self.config = config + extra_config
        self.run: Running | None = None
        self.generation = 0

    def start(self, timeout: float = 60.0) -> "Instance":
        self.generation += 1
        self.run = Running(["--app", self.app, "--bind", f"127.0.0.1:{self.port}", *self.args],
                           config=self.config, env={"LB_INSTANCE": f"{self.name}.{self.generation}"},
                           timeout=timeout)
        return self

    def sigterm(self) -> None:
        assert self.run is not None
        self.run.signal(signal.SIGTERM)

    def wait_exit(self, timeout: float = 60.0) -> int:
        assert self.run is not None
        rc = self.run.wait_exit(timeout)
        return rc

    def close(self) -> None:
        if self.run is not None:
            self.run.close()
            self.run = None

    def readyz(self, timeout: float = 2.0) -> int | None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.admin_port, timeout=timeout)
            conn.request("GET", "/readyz")
            status = conn.getresponse().status
            conn.close()
            return status
        except OSError:
            return None


def _merge_server(config: str, line: str) -> str:
    """Add ``line`` to the [server] table of a TOML text (TOML forbids a second one)."""
    if "[server]\n" in config:
        return config.replace("[server]\n", f"[server]\n{line}\n", 1)
    return config + f"\n[server]\n{line}\n"


# -------------------------------------------------------------------- haproxy


def stop_process(proc: subprocess.Popen[bytes], sig: int, grace: float) -> None:
    """``sig``, up to ``grace`` seconds, then SIGKILL: a balancer we started never outlives its test."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def render_haproxy(src: str, *, frontend_port: int, servers: list[tuple[str, int, int]], run_dir: Path,
                   retries: bool = True) -> str:
    """The shipped haproxy.cfg with only what a loopback test must change:
    no chroot/user/daemon/syslog, a small maxconn, the stats socket in ``run_dir``, the frontend
    on ``frontend_port``, the example ``server`` lines replaced by ``servers``
    (name, serving port, admin port) and the stats frontend left out.  Every
    option that decides behaviour (checks, retries, redispatch, timeouts,
    balance, reuse) is kept as shipped.  ``retries=False`` also turns off every
    retry and redispatch, so a request the backend loses reaches the client."""
    out: list[str] = []
    section = ""
    skip_section = False
    servers_written = False
    for line in src.splitlines():
        s = line.split("#", 1)[0].strip()
        words = s.split()
        if line[:1].strip() and words:  # a section header starts at column 0
            section = " ".join(words[:2])
            skip_section = section == "frontend stats"
        if skip_section:
            continue
        if section == "global" and words and words[0] in ("log", "chroot", "user", "group", "daemon"):
            continue
        if section == "global" and words[:1] == ["maxconn"]:  # capacity, not behaviour: fits a test's fd limit
            line = "    maxconn 2000"
        if section == "global" and words[:2] == ["stats", "socket"]:
            line = f"    stats socket {run_dir}/admin.sock mode 600 level admin"
        if not retries and (words[:1] in (["retry-on"], ["retries"]) or words[:2] == ["option", "redispatch"]):
            line = "    retries 0" if words[0] == "retries" else f"    # {s}"
        if section.startswith("frontend") and words[:1] == ["bind"]:
            line = f"    bind 127.0.0.1:{frontend_port}"
        if section.startswith("backend") and words[:1] == ["server"]:
            if not servers_written:
                out += [f"    server {n} 127.0.0.1:{p} port {a}" for n, p, a in servers]
                servers_written = True
            continue
        out.append(line)
    if not servers_written:
        raise ValueError("no server lines in the backend of the HAProxy config")
    return "\n".join(out) + "\n"


class HAProxy:
    """A real HAProxy in the foreground (``-db``), on loopback, no system service."""

    def __init__(self, servers: list[tuple[str, int, int]], *, src: Path = HAPROXY_CFG, retries: bool = True) -> None:
        if HAPROXY is None:
            raise RuntimeError("haproxy is not installed (Debian package haproxy; scripts/install)")
        self.dir = Path(tempfile.mkdtemp(prefix="ns-haproxy-"))
        self.port = free_port()
        self.socket_path = self.dir / "admin.sock"
        self.cfg = self.dir / "haproxy.cfg"
        self.cfg.write_text(render_haproxy(src.read_text(), frontend_port=self.port, servers=servers, run_dir=self.dir,
                                           retries=retries))
        check = subprocess.run([HAPROXY, "-c", "-f", str(self.cfg)], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy -c failed:\n{check.stdout}{check.stderr}\n{self.cfg.read_text()}")
        self.log = open(self.dir / "haproxy.log", "wb")
        self.proc = subprocess.Popen([HAPROXY, "-db", "-f", str(self.cfg)], stdout=self.log, stderr=self.log,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not self.socket_path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"haproxy did not start (rc={self.proc.poll()}):\n{self.log_text()}")
            time.sleep(0.05)

    def log_text(self) -> str:
        try:
            return (self.dir / "haproxy.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def command(self, cmd: str) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(self.socket_path))
            s.sendall(cmd.encode() + b"\n")
            chunks = []
            while True:
                b = s.recv(65536)
                if not b:
                    break
                chunks.append(b)
        return b"".join(chunks).decode()

    def stats(self) -> dict[str, dict[str, str]]:
        """``show stat`` of the numaserve backend: server name -> CSV fields."""
        text = self.command("show stat")
        lines = [ln for ln in text.splitlines() if ln]
        header = lines[0].lstrip("# ").split(",")
        out = {}
        for ln in lines[1:]:
            row = dict(zip(header, ln.split(",")))
            if row.get("pxname") == "numaserve":
                out[row["svname"]] = row
        return out

    def wait_status(self, server: str, pred: Callable[[str], bool], what: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        status = ""
        while time.monotonic() < deadline:
            status = self.stats().get(server, {}).get("status", "")
            if pred(status):
                return status
            time.sleep(0.05)
        raise AssertionError(f"haproxy: server {server} not {what} within {timeout:g}s (status {status!r})\n"
                             + self.log_text())

    def close(self) -> None:
        stop_process(self.proc, signal.SIGUSR1, 5)  # soft stop
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------------- nginx


def render_nginx(src: str, *, listen_port: int, servers: list[int]) -> str:
    """The shipped nginx example with its ``listen`` on loopback and the
    example upstream ``server`` lines replaced (their parameters kept)."""
    out: list[str] = []
    written = False
    for line in src.splitlines():
        words = line.split("#", 1)[0].split()
        if words[:1] == ["server"] and len(words) > 1 and ":" in words[1]:
            params = " ".join(words[2:]).rstrip(";")
            if not written:
                out += [f"    server 127.0.0.1:{p} {params};" for p in servers]
                written = True
            continue
        if words[:1] == ["listen"]:
            line = f"    listen 127.0.0.1:{listen_port};"
        out.append(line)
    if not written:
        raise ValueError("no upstream server lines in the nginx config")
    return "\n".join(out) + "\n"


def nginx_main_conf(run_dir: Path, include: Path, *, foreground: bool = True) -> str:
    """A minimal main nginx.conf (unprivileged paths in ``run_dir``) around the example."""
    return (f"pid {run_dir}/nginx.pid;\nerror_log {run_dir}/error.log;\n"
            + ("daemon off;\n" if foreground else "")
            + "events {}\n"
            f"http {{\n  access_log off;\n  client_body_temp_path {run_dir}/body;\n  proxy_temp_path {run_dir}/proxy;\n"
            f"  fastcgi_temp_path {run_dir}/fastcgi;\n  uwsgi_temp_path {run_dir}/uwsgi;\n  scgi_temp_path {run_dir}/scgi;\n"
            f"  include {include};\n}}\n")


class Nginx:
    """A real nginx in the foreground on loopback, from deploy/nginx/numaserve.conf."""

    def __init__(self, servers: list[int], *, src: Path = NGINX_CONF) -> None:
        if NGINX is None:
            raise RuntimeError("nginx is not installed (Debian package nginx-light; scripts/install)")
        self.dir = Path(tempfile.mkdtemp(prefix="ns-nginx-"))
        self.port = free_port()
        (self.dir / "numaserve.conf").write_text(render_nginx(src.read_text(), listen_port=self.port, servers=servers))
        (self.dir / "nginx.conf").write_text(nginx_main_conf(self.dir, self.dir / "numaserve.conf"))
        argv = [NGINX, "-p", str(self.dir), "-c", str(self.dir / "nginx.conf")]
        check = subprocess.run(argv + ["-t"], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise RuntimeError(f"nginx -t failed:\n{check.stderr}")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: self._listening() or self.proc.poll() is not None, 20, "nginx to listen")
        if self.proc.poll() is not None:
            raise RuntimeError(f"nginx exited rc={self.proc.returncode}:\n{self.error_log()}")

    def _listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def error_log(self) -> str:
        try:
            return (self.dir / "error.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def close(self) -> None:
        stop_process(self.proc, signal.SIGQUIT, 10)  # graceful shutdown
        shutil.rmtree(self.dir, ignore_errors=True)


# ----------------------------------------------------------------------- load


def is_up(status: str) -> bool:
    """UP, or slowstart's "UP 10%"-style ramp; not "UP 1/2" (going down) nor NOLB."""
    return status.startswith("UP") and "/" not in status


def is_down(status: str) -> bool:
    return status.startswith("DOWN") and "/" not in status


@dataclass
class LoadReport:
    ok: collections.Counter[str] = field(default_factory=collections.Counter)   # by kind
    failures: collections.Counter[str] = field(default_factory=collections.Counter)  # by class
    examples: dict[str, list[str]] = field(default_factory=dict)
    answered_by: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def summary(self) -> str:
        ex = "; ".join(f"{k}: {v[:3]}" for k, v in self.examples.items())
        return (f"ok {dict(self.ok)}; failures {dict(self.failures)} (shed_503 = admission 503 from numaserve, "
                f"lb_5xx = 502/503/504 from the balancer, disconnect = connection reset/closed without an answer); "
                f"answered by {dict(self.answered_by)}; examples: {ex}")


class FleetLoad:
    """Bounded client load through the balancer: keep-alive GETs, one new
    connection per GET, keep-alive POSTs with a body, and SSE streams.  Every
    request is recorded; nothing retries at the client."""

    def __init__(self, port: int, *, keepalive: int = 2, fresh: int = 2, posts: int = 1, streams: int = 1,
                 pace: float = 0.02, max_seconds: float = 240.0, timeout: float = 20.0) -> None:
        self.port, self.pace, self.timeout, self.max_seconds = port, pace, timeout, max_seconds
        self.report = LoadReport()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        kinds: list[Callable[[], None]] = ([self._keepalive] * keepalive + [self._fresh] * fresh
                                           + [self._posts] * posts + [self._streams] * streams)
        self._threads = [threading.Thread(target=k, daemon=True) for k in kinds]

    def __enter__(self) -> "FleetLoad":
        self._t0 = time.monotonic()
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> LoadReport:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout + 10)
        return self.report

    def _running(self) -> bool:
        if self._stop.wait(self.pace):
            return False
        return time.monotonic() - self._t0 < self.max_seconds

    def _fail(self, cls: str, what: str) -> None:
        with self._lock:
            self.report.failures[cls] += 1
            self.report.examples.setdefault(cls, []).append(what[:160])

    def _ok(self, kind: str, body: bytes) -> None:
        with self._lock:
            self.report.ok[kind] += 1
            try:
                self.report.answered_by[json.loads(body)["instance"]] += 1   # "name.generation"
            except (ValueError, KeyError, TypeError):
                pass

    def _classify(self, kind: str, status: int, body: bytes) -> None:
        if 200 <= status < 300:
            self._ok(kind, body)
        elif status == 503 and b'"overloaded"' in body:
            self._fail("shed_503", f"{kind}: {body[:100]!r}")
        elif status in (502, 503, 504):
            self._fail("lb_5xx", f"{kind}: {status} {body[:100]!r}")
        else:
            self._fail("other_status", f"{kind}: {status} {body[:100]!r}")

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)

    def _persistent(self, kind: str, send: Callable[[http.client.HTTPConnection], None]) -> None:
        conn: http.client.HTTPConnection | None = None
        while self._running():
            conn = conn or self._conn()
            try:
                send(conn)
                r = conn.getresponse()
                body = r.read()
                self._classify(kind, r.status, body)
                if (r.getheader("connection") or "").lower() == "close":
                    conn.close()
                    conn = None
            except Exception as e:  # every failure is recorded, none hidden
                self._fail("disconnect", f"{kind}: {type(e).__name__}: {e}")
                conn.close()
                conn = None
        if conn is not None:
            conn.close()

    def _keepalive(self) -> None:
        self._persistent("keepalive", lambda c: c.request("GET", "/"))

    def _posts(self) -> None:
        body = os.urandom(2048).hex().encode()
        self._persistent("post", lambda c: c.request("POST", "/v1/echo", body=body,
                                                      headers={"content-type": "application/octet-stream"}))

    def _fresh(self) -> None:
        while self._running():
            conn = self._conn()
            try:
                conn.request("GET", "/", headers={"Connection": "close"})
                r = conn.getresponse()
                self._classify("fresh", r.status, r.read())
            except Exception as e:
                self._fail("disconnect", f"fresh: {type(e).__name__}: {e}")
            finally:
                conn.close()

    def _streams(self) -> None:
        while self._running():
            conn = self._conn()
            try:
                conn.request("GET", "/stream?n=20&dt=0.05")
                r = conn.getresponse()
                body = r.read()
                if r.status == 200:
                    events = re.findall(rb"^data: (.*)$", body, re.M)
                    if len(events) != 21 or events[-1] != b"done":
                        self._fail("truncated_stream", f"stream: {len(events)} events, last {events[-1:]!r}")
                    else:
                        self._ok("stream", events[0])
                else:
                    self._classify("stream", r.status, body)
            except Exception as e:
                self._fail("disconnect", f"stream: {type(e).__name__}: {e}")
            finally:
                conn.close()


def wait_until(pred: Callable[[], Any], timeout: float, what: str, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
