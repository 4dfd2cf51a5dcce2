"""The three servers under test, behind one interface.

- ``numaserve start`` with the bench app (``--app benchapp:app``), default
  config except a private runtime dir, an admin port picked by the kernel and
  quiet JSON logs: what an operator gets out of the box.
- ``uvicorn --workers N`` (its own multiprocess supervisor, one shared socket).
- ``gunicorn -k <UvicornWorker> -w N`` (gunicorn's arbiter, one shared socket).
- ``granian --interface asgi --workers N`` (Rust HTTP stack; the hot-path scenario only).

Readiness has two meanings, measured the same way for every server where the
server lets us: *first answer* (the port returns 200) and *all ready* (every
worker finished its start-up: numaserve's own ``status`` says every slot is
ready; the peers' workers each log uvicorn's "Application startup complete.").
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchlib import procs
from benchlib.env import REPO, APP_DIR, peer_worker_class

APP = "benchapp:app"
STARTUP_LINE = b"Application startup complete"

NUMASERVE_BASE_TOML = """
[admin]
bind = "127.0.0.1:0"
[log]
level = "warning"
format = "json"
"""

KINDS = ("numaserve", "uvicorn", "gunicorn")
#: Peers only some scenarios run (they bind their own sockets and have no reload/kill story
#: the other scenarios measure): granian (Rust HTTP server, ASGI interface).
EXTRA_KINDS = ("granian",)
#: Named variants of a kind (``--servers`` accepts them): gunicorn's ``--preload`` (the app
#: imported once in the master, workers forked from it); numaserve with every worker exec'd,
#: or forked.
VARIANTS = {
    "gunicorn-preload": ("gunicorn", {"preload": True}),
    "numaserve-exec": ("numaserve", {"numaserve_toml": '\n[worker]\nstart = "exec"\n'}),
    "numaserve-fork": ("numaserve", {"numaserve_toml": '\n[worker]\nstart = "fork"\n'}),
}


@dataclass
class ServerConfig:
    """What to start: which server, how many workers, and the few knobs a scenario needs."""

    kind: str
    workers: int = 2
    label: str = ""                       # name in tables; defaults to kind
    cpus: tuple[int, ...] | None = None   # affinity of the whole server tree
    env: dict[str, str] = field(default_factory=dict)
    numaserve_args: tuple[str, ...] = ()  # extra `numaserve start` flags
    numaserve_toml: str = ""              # appended to the base config
    app: str = APP                        # module:attribute in scripts/bench_apps
    checkout: str = ""                    # numaserve: run this source tree instead of ours (before/after)
    preload: bool = False                 # gunicorn: --preload

    def __post_init__(self) -> None:
        if self.kind in VARIANTS:
            base, extra = VARIANTS[self.kind]
            self.label = self.label or self.kind
            self.kind = base
            for key, value in extra.items():
                setattr(self, key, (getattr(self, key) + value) if key == "numaserve_toml" else value)

    @property
    def name(self) -> str:
        return self.label or self.kind


class ServerError(RuntimeError):
    """A server did not start or did not answer as expected."""


_LIVE: "set[Server]" = set()


def stop_all() -> None:
    """Stop every server still running (exit and signal handlers call this)."""
    for srv in list(_LIVE):
        srv.stop()


class Server:
    """One running server under test; always ``stop()`` it (use ``with``)."""

    def __init__(self, cfg: ServerConfig) -> None:
        if cfg.kind not in KINDS + EXTRA_KINDS:
            raise ValueError(f"unknown server kind {cfg.kind!r}")
        self.cfg = cfg
        self.tmp = Path(tempfile.mkdtemp(prefix=f"bench-{cfg.kind}-"))
        self.log = self.tmp / "server.log"
        self.rt = self.tmp / "rt"
        self.port = procs.free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.t_spawn = 0.0

    # ------------------------------------------------------------------ start

    def argv(self) -> list[str]:
        c = self.cfg
        if c.kind == "numaserve":
            toml = self.tmp / "numaserve.toml"
            toml.write_text(NUMASERVE_BASE_TOML + c.numaserve_toml)
            args = list(c.numaserve_args)
            if "--nodes" not in args:
                args += ["--nodes", "0"]
            if "--workers-per-node" not in args:
                args += ["--workers-per-node", str(c.workers)]
            return [sys.executable, "-m", "numaserve", "start", "--config", str(toml), "--runtime-dir",
                    str(self.rt), "--bind", f"127.0.0.1:{self.port}", "--app", c.app, "--app-dir", str(APP_DIR),
                    *args]
        if c.kind == "uvicorn":
            return [sys.executable, "-m", "uvicorn", c.app, "--app-dir", str(APP_DIR), "--host", "127.0.0.1",
                    "--port", str(self.port), "--workers", str(c.workers), "--no-access-log",
                    "--log-level", "info"]
        if c.kind == "granian":  # the way its users run it; the app dir is on PYTHONPATH
            return [sys.executable, "-m", "granian", "--interface", "asgi", "--workers", str(c.workers),
                    "--host", "127.0.0.1", "--port", str(self.port), "--no-access-log", "--log-level", "info",
                    c.app]
        return [sys.executable, "-m", "gunicorn", "-k", peer_worker_class(), "-w", str(c.workers),
                "-b", f"127.0.0.1:{self.port}", "--chdir", str(APP_DIR), "--log-level", "info",
                "--error-logfile", "-", *(["--preload"] if c.preload else []), c.app]

    def start(self) -> "Server":
        env = dict(os.environ)
        env.pop("NUMASERVE_CONFIG", None)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(APP_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["PYTHONWARNINGS"] = "ignore::DeprecationWarning"   # uvicorn.workers is deprecated but works
        env.update(self.cfg.env)
        cwd = REPO
        if self.cfg.checkout:  # `python -m` puts the working directory first on sys.path: run from there
            cwd = Path(self.cfg.checkout)
            env["PYTHONPATH"] = os.pathsep.join([str(cwd), str(APP_DIR)])
        self.t_spawn = time.perf_counter()
        self.proc = procs.spawn(self.argv(), env=env, cwd=cwd, log=self.log, cpus=self.cfg.cpus)
        _LIVE.add(self)
        return self

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def master_pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise ServerError(f"{self.cfg.name} exited (rc={self.proc.returncode if self.proc else None}):\n"
                              f"{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def startup_lines(self) -> int:
        """Peers: workers that logged "Application startup complete" so far."""
        try:
            return self.log.read_bytes().count(STARTUP_LINE)
        except OSError:
            return 0

    def ops(self, verb: str, args: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
        """numaserve only: one ops request (what the CLI sends, without starting an interpreter)."""
        from numaserve.control.client import OpsTarget, ops_call

        return ops_call(OpsTarget(runtime_dir=self.rt), verb, args, timeout=timeout)

    def cli(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """numaserve only: run the real CLI against this supervisor."""
        return subprocess.run([sys.executable, "-m", "numaserve", *args, "--runtime-dir", str(self.rt)],
                              capture_output=True, text=True, timeout=timeout, cwd=str(REPO))

    def all_ready(self) -> bool:
        """Every worker finished starting (numaserve: status; peers: start-up log lines)."""
        if self.cfg.kind == "numaserve":
            try:
                st = self.ops("status", timeout=2.0)
            except Exception:
                return False
            slots = st.get("slots") or []
            return bool(slots) and all(s.get("state") == "ready" for s in slots)
        if self.cfg.kind == "granian":  # no per-worker start-up line to count: its workers and an answer
            return len(self.worker_pids()) >= self.cfg.workers and http_ok(self.url + "/", timeout=1.0)
        return self.startup_lines() >= self.cfg.workers and len(self.worker_pids()) >= self.cfg.workers

    def wait_ready(self, timeout: float = 120.0) -> dict[str, float]:
        """Block until the port answers and every worker is ready; seconds since spawn."""
        deadline = time.monotonic() + timeout
        first = all_ = None
        while time.monotonic() < deadline:
            self._check_alive()
            now = time.perf_counter() - self.t_spawn
            if first is None and http_ok(self.url + "/", timeout=1.0):
                first = time.perf_counter() - self.t_spawn
            if all_ is None and self.all_ready():
                all_ = time.perf_counter() - self.t_spawn
            if first is not None and all_ is not None:
                return {"first_answer_s": round(first, 3), "all_ready_s": round(all_, 3)}
            time.sleep(0.02 if now < 5 else 0.1)
        raise ServerError(f"{self.cfg.name} not ready within {timeout:g}s (first={first}, all={all_}):\n"
                          f"{self.log_tail()}")

    # ----------------------------------------------------------------- workers

    def worker_pids(self) -> list[int]:
        """Pids of the serving workers (not helpers such as multiprocessing's tracker)."""
        if self.proc is None:
            return []
        if self.cfg.kind == "numaserve":
            try:
                st = self.ops("status", timeout=2.0)
            except Exception:
                return []
            return [int(s["pid"]) for s in st.get("slots", []) if s.get("pid")]
        if self.cfg.kind == "uvicorn" and self.cfg.workers == 1:
            return [self.proc.pid] if self.proc.poll() is None else []   # uvicorn serves in-process then
        out = []
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return []
        for p in children:
            try:
                cmd = " ".join(p.cmdline())
                if "resource_tracker" in cmd or p.status() == psutil.STATUS_ZOMBIE:
                    continue
            except psutil.Error:
                continue
            out.append(p.pid)
        return out

    def kill_one_worker(self) -> int:
        """SIGKILL one serving worker (the first listed); returns its pid."""
        pids = self.worker_pids()
        if not pids:
            raise ServerError(f"{self.cfg.name}: no worker to kill")
        os.kill(pids[0], signal.SIGKILL)
        return pids[0]

    def wait_workers_replaced(self, old: set[int], timeout: float, lines_before: int) -> float | None:
        """Seconds until none of ``old`` serves any more and a full set of new
        workers is ready (peers: counted by start-up log lines); None on timeout."""
        t0 = time.perf_counter()
        need = len(old)
        while time.perf_counter() - t0 < timeout:
            pids = set(self.worker_pids())
            fresh = pids - old
            if not (pids & old) and len(pids) >= self.cfg.workers:
                if self.cfg.kind == "numaserve":
                    if self.all_ready():
                        return time.perf_counter() - t0
                elif self.startup_lines() - lines_before >= need and len(fresh) >= need:
                    return time.perf_counter() - t0
            time.sleep(0.05)
        return None

    def reload(self, timeout: float = 120.0) -> dict[str, Any]:
        """Roll every worker the server's own way; returns when it says it is done.

        numaserve: ``numaserve reload --wait`` (make-before-break per slot);
        uvicorn and gunicorn: SIGHUP to the master, done when every old worker
        has exited and as many new ones have logged their start-up.
        """
        old = set(self.worker_pids())
        lines = self.startup_lines()
        t0 = time.perf_counter()
        if self.cfg.kind == "numaserve":
            r = self.cli("reload", "--wait", timeout=timeout)
            done = time.perf_counter() - t0
            return {"ok": r.returncode == 0, "done_s": round(done, 3),
                    "detail": (r.stdout + r.stderr).strip()[-300:]}
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)
        replaced = self.wait_workers_replaced(old, timeout, lines)
        return {"ok": replaced is not None, "done_s": None if replaced is None else round(replaced, 3),
                "detail": "" if replaced is not None else self.log_tail(10)}

    # ------------------------------------------------------------------- stop

    def stop(self) -> None:
        """Graceful stop, then kill whatever is left; remove the temp dir."""
        try:
            if self.proc is not None:
                procs.stop_tree(self.proc, grace=15.0)
        finally:
            _LIVE.discard(self)
            if os.environ.get("BENCH_KEEP_LOGS") != "1":
                shutil.rmtree(self.tmp, ignore_errors=True)


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """One GET on a fresh connection (no proxy: loopback only)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout)
    try:
        conn.request("GET", u.path or "/", headers={"Connection": "close"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """One GET on a fresh connection answered 200."""
    try:
        return http_get(url, timeout)[0] == 200
    except (OSError, http.client.HTTPException):
        return False


def http_json(url: str, timeout: float = 2.0) -> Any:
    return json.loads(http_get(url, timeout)[1])
