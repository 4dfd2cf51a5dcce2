"""Run the real `numaserve start` as a subprocess and talk to it like an operator."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
APPS = Path(__file__).resolve().parent / "apps"

FAST_CONFIG = """
[server]
graceful_timeout = 10.0
keepalive_timeout = 2.0
[supervisor]
heartbeat_interval = 0.25
heartbeat_timeout = 3.0
ready_timeout = 30.0
backoff_initial = 0.1
backoff_max = 2.0
backoff_reset_after = 30.0
abort_grace = 1.0
verify_interval = 2.0
[admin]
bind = "127.0.0.1:0"
[log]
level = "info"
format = "json"
"""

#: Appended to a config: workers exec'd one by one, for tests that pin per-process import-time
#: behaviour (an app failing at import in one slot, import-time rlimits, /proc/PID/environ).
EXEC_WORKERS = '\n[worker]\nstart = "exec"\n'


def numaserve_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "numaserve", *args]


class Running:
    """One supervisor started by a test; always cleaned up (no stray workers)."""

    def __init__(self, args: list[str], *, config: str = FAST_CONFIG, env: dict[str, str] | None = None,
                 expect_ready: bool = True, timeout: float = 60.0, tty_stderr: bool = False,
                 nofile: int | None = None) -> None:
        self.rt = Path(tempfile.mkdtemp(prefix="ns-rt-"))
        self.logdir = Path(tempfile.mkdtemp(prefix="ns-log-"))
        self.config = self.logdir / "numaserve.toml"
        self.config.write_text(config)
        self.stdout = open(self.logdir / "stdout", "wb")
        self.stderr_path = self.logdir / "stderr"
        self.stderr = open(self.stderr_path, "wb")
        e = dict(os.environ)
        e.pop("NUMASERVE_CONFIG", None)
        e.update(env or {})
        # the test apps stay importable even when ``env`` brings its own PYTHONPATH
        path = [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p]
        e["PYTHONPATH"] = os.pathsep.join([str(APPS)] + [p for p in path if p != str(APPS)])
        self.argv = numaserve_argv("start", "--config", str(self.config), "--runtime-dir", str(self.rt), *args)
        limit = None
        if nofile is not None:  # `ulimit -n N` for the supervisor (soft and hard, as the shell does)
            import resource

            def limit() -> None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
        err: Any = self.stderr
        self._pty_copier = None
        if tty_stderr:  # stderr on a terminal, as for an operator; what it shows goes to the file
            import pty
            import threading

            master, slave = pty.openpty()
            err = slave
            self._pty_copier = threading.Thread(target=_copy_pty, args=(master, self.stderr), daemon=True)
        self.proc = subprocess.Popen(self.argv, stdout=self.stdout, stderr=err, env=e,
                                     stdin=subprocess.DEVNULL, cwd=str(REPO), preexec_fn=limit)
        if tty_stderr:
            os.close(slave)
            self._pty_copier.start()
        self.port: int | None = None
        if expect_ready:
            self.wait_ready(timeout)

    # -- queries ---------------------------------------------------------
    def ops(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(numaserve_argv(*args, "--runtime-dir", str(self.rt)), capture_output=True,
                              text=True, timeout=timeout, cwd=str(REPO))

    def status(self) -> dict[str, Any]:
        r = self.ops("status", "--json")
        if r.returncode != 0:
            raise RuntimeError(f"status failed rc={r.returncode}: {r.stderr.strip()}\n{self.log_tail()}")
        return json.loads(r.stdout)

    def slots(self) -> list[dict[str, Any]]:
        return self.status()["slots"]

    def wait_for(self, pred: Any, timeout: float = 30.0, what: str = "condition") -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] | Exception = {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"supervisor exited rc={self.proc.returncode} waiting for {what}\n{self.log_tail()}")
            try:
                last = self.status()
                if pred(last):
                    return last
            except RuntimeError as e:
                last = e
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; last status: {last}\n{self.log_tail()}")

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        st = self.wait_for(
            lambda s: s["slots"] and all(x["state"] == "ready" for x in s["slots"]), timeout, "all slots ready"
        )
        tcp = [a for a in st["supervisor"]["listeners"] if not a.startswith("unix:")]
        if tcp:   # unix binds only: no port
            self.port = int(tcp[0].rsplit(":", 1)[1])
        return st

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.stderr_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.stderr_path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    # -- control ---------------------------------------------------------
    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        pids = []
        try:
            if self.proc.poll() is None:
                try:
                    pids = [s["pid"] for s in self.slots() if s["pid"]]
                except Exception:
                    pass
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(20)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
        finally:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if self._pty_copier is not None:
                self._pty_copier.join(5)
            self.stdout.close()
            self.stderr.close()
            shutil.rmtree(self.rt, ignore_errors=True)
            shutil.rmtree(self.logdir, ignore_errors=True)

    def __enter__(self) -> "Running":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _copy_pty(master: int, out: Any) -> None:
    """Copy a pty's output to ``out`` until every writer has closed it (EIO)."""
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            out.write(data)
            out.flush()
    finally:
        os.close(master)


def http_get(port: int, path: str = "/", *, timeout: float = 10.0, host: str = "127.0.0.1") -> tuple[int, bytes]:
    """One request on a fresh connection (so SO_REUSEPORT hashing picks a slot)."""
    import http.client

    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def two_pretend_nodes(tmp_path: Path, extra: str = "") -> tuple[Path, list[int]]:
    """A declared topology mapping this machine's first two usable CPUs onto
    pretend nodes 0 and 1 (both backed by real memory node 0); skips the test
    on a machine with fewer than two usable CPUs.  ``extra`` is appended (e.g.
    a ``[nic.X]`` table).  Returns the file and the two CPUs."""
    import pytest

    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        pytest.skip("needs 2 usable CPUs")
    p = tmp_path / "topo.toml"
    p.write_text(
        f'mode = "replace"\n[[node]]\nid = 0\ncpus = "{cpus[0]}"\nmemory_node = 0\n'
        f'[[node]]\nid = 1\ncpus = "{cpus[1]}"\nmemory_node = 0\n' + extra
    )
    return p, cpus

