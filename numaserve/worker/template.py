"""A node's warm template: import the app once, bound to the node, then fork workers.

Started by the supervisor through the exec trampoline (``numaserve.bind.launch``)
with the node's CPUs and memory policy in force before this interpreter
starts, so the app's import-time allocations and the preload hook's (model
weights) land on the node.  Then it waits on its control socket for fork
requests; each worker it forks shares the imported pages copy-on-write.

Control channel: one ``AF_UNIX``/``SOCK_SEQPACKET`` socketpair, inherited
from the supervisor.  Not ZeroMQ: a ZeroMQ context starts I/O threads, and a
process with threads must not fork (only the forking thread survives; locks
held by the others stay held forever).  A seqpacket socketpair keeps message
boundaries, carries the slot's listener fds (``SCM_RIGHTS``), needs no
thread, has no address anyone else can reach, and reads end-of-file the
moment the supervisor is gone.  Messages are JSON objects (``t`` = type):

    template → supervisor  {"t": "ready", pid, import_s, preload_s, threads}
                           {"t": "failed", reason}                (then exit 3)
    supervisor → template  {"t": "fork", id, spec, token, env, cpus, reaper}
                           + the slot's listener fds
    template → supervisor  {"t": "forked", id, pid} | {"t": "refused", id, reason, threads}
                           | {"t": "error", id, reason}

Fork: the template double-forks; the intermediate exits at once, so the
worker reparents to the supervisor (a child subreaper, see
``numaserve.supervisor.workerproc``), which reaps and supervises it like an
exec'd worker.  The worker, still single-threaded, narrows its CPU affinity
to its slot (``sched_setaffinity``), keeps the node's memory policy (fork
copies it), waits until it is the supervisor's child, arms the parent-death
signal, takes the slot's environment, spec and spawn token, and enters the
worker's normal entry point (``numaserve.worker.main.run_worker``).

Fork safety: a template with more than one thread refuses every fork and
says which threads and the imports that probably started them; the
supervisor then execs that node's workers instead.
"""

from __future__ import annotations

import array
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any, NoReturn

__all__ = [
    "BOOT_IDLE_S",
    "BootPriority",
    "EXIT_TEMPLATE_FAILED",
    "TEMPLATE_SPEC_ENV",
    "THREAD_SUSPECTS",
    "TemplateSpec",
    "EnvSpec",
    "RequestLoop",
    "await_reparent",
    "child_exit",
    "can_restore_priority",
    "describe_threads",
    "double_fork",
    "lower_priority",
    "main",
    "recv_msg",
    "replace_environ",
    "run_template",
    "set_comm",
    "send_msg",
]

TEMPLATE_SPEC_ENV = "NUMASERVE_TEMPLATE_SPEC"
EXIT_TEMPLATE_FAILED = 3        # like a worker whose app does not import: a boot failure
MAX_MSG = 1 << 20               # a fork request carries the worker spec: small, but bounded
MAX_FDS = 16
REPARENT_TIMEOUT_S = 5.0

#: Modules known to start threads at import or first use, with what to do about it.
THREAD_SUSPECTS: dict[str, str] = {
    "numpy": "a BLAS/OpenMP pool (set OMP_NUM_THREADS=1 / OPENBLAS_NUM_THREADS=1 for the template, or use threadpoolctl)",
    "scipy": "a BLAS/OpenMP pool",
    "torch": "torch's intra-op/inter-op pools (torch.set_num_threads(1) before work; avoid CUDA init in the template)",
    "tensorflow": "TensorFlow's thread pools",
    "onnxruntime": "ONNX Runtime's session thread pool",
    "jax": "XLA's runtime threads",
    "numexpr": "numexpr's worker pool (NUMEXPR_NUM_THREADS)",
    "grpc": "gRPC's poller threads",
    "zmq": "a ZeroMQ context's I/O thread (create contexts in the worker, not at import)",
    "concurrent.futures": "a ThreadPoolExecutor",
    "sentry_sdk": "Sentry's transport worker",
    "opentelemetry": "an OpenTelemetry batch exporter",
}


class EnvSpec:
    """A start-up spec passed as JSON in one environment variable (``ENV``)."""

    ENV = ""
    WHAT = ""

    def to_env(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Any:
        env = os.environ if environ is None else environ
        raw = env.get(cls.ENV)
        if not raw:
            raise RuntimeError(f"{cls.ENV} is not set: {cls.WHAT} are started by `numaserve start`")
        return cls(**json.loads(raw))


class TemplateSpec(EnvSpec):
    """What the supervisor tells a template at start (JSON in ``NUMASERVE_TEMPLATE_SPEC``)."""

    ENV = TEMPLATE_SPEC_ENV
    WHAT = "templates"

    def __init__(self, *, node: int, generation: int, app: str, app_dir: str, preload: str, control_fd: int,
                 log_level: str = "info", log_format: str = "json", gc_freeze: bool = True,
                 preimport: Sequence[str] = (), boot_nice: int = 0) -> None:
        self.node = node
        self.generation = generation
        self.app = app
        self.app_dir = app_dir
        self.preload = preload
        self.control_fd = control_fd
        self.log_level = log_level
        self.log_format = log_format
        self.gc_freeze = gc_freeze
        self.preimport = list(preimport)
        self.boot_nice = int(boot_nice)


# --- wire -----------------------------------------------------------------------


def send_msg(sock: socket.socket, msg: Mapping[str, Any], fds: Sequence[int] = ()) -> None:
    """One JSON message (and fds) as one seqpacket record."""
    data = json.dumps(msg, separators=(",", ":")).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv_msg(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """One record → (message, received fds); (None, []) at end-of-file.

    ValueError for a record that is not a JSON object (its fds are closed).
    """
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(MAX_MSG, socket.CMSG_SPACE(MAX_FDS * fds.itemsize))
    got: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(payload[: len(payload) - (len(payload) % a.itemsize)])
            got.extend(a)
    if not data and not got:
        return None, []
    try:
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise ValueError("message or its fds truncated")
        msg = json.loads(data)
        if not isinstance(msg, dict):
            raise ValueError("not a JSON object")
    except ValueError:
        for fd in got:
            _close(fd)
        raise
    return msg, got


def trim_heap() -> bool | None:
    """glibc's ``malloc_trim(0)`` before the first fork: the free pages the app's import left in
    glibc's heaps go back to the kernel instead of being counted in the template's PSS (and the
    workers' share of it).  None without glibc."""
    from numaserve.memtrim import malloc_trim  # the supervisor's settle step makes the same call
    return malloc_trim()


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


# --- fork safety -----------------------------------------------------------------


def task_comms(proc: str = "/proc") -> dict[int, str]:
    """tid → thread name as the kernel knows it (``/proc/self/task/*/comm``)."""
    out: dict[int, str] = {}
    try:
        tids = os.listdir(f"{proc}/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{proc}/self/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
        except (OSError, ValueError):
            continue
    return out


def describe_threads(py_threads: Iterable[tuple[str, int | None, str]], comms: Mapping[int, str],
                     modules: Iterable[str], main_tid: int) -> list[str]:
    """Every thread but the main one, named, with the import that likely started it.

    ``py_threads``: (name, native id, module of its target) from
    ``threading.enumerate()``; ``comms``: every kernel task's name, so threads
    started from C (a BLAS pool) show up too; ``modules``: ``sys.modules`` keys.
    Pure: the template and the tests pass what they observed.
    """
    out: list[str] = []
    seen: set[int] = {main_tid}
    for name, tid, module in py_threads:
        if tid == main_tid:
            continue
        if tid is not None:
            seen.add(tid)
        where = f", started by {module}" if module else ""
        out.append(f"python thread {name!r} (tid {tid}{where})")
    native = [(tid, comm) for tid, comm in sorted(comms.items()) if tid not in seen]
    if native:
        loaded = set(modules)
        suspects = [f"{mod} ({why})" for mod, why in THREAD_SUSPECTS.items()
                    if mod in loaded or any(m.startswith(mod + ".") for m in loaded)]
        names = ", ".join(f"{comm!r} (tid {tid})" for tid, comm in native)
        hint = "; likely started by " + "; ".join(suspects) if suspects else ""
        out.append(f"native threads {names}{hint}")
    return out


def current_threads() -> list[str]:
    """This process's extra threads, described (empty when single-threaded)."""
    comms = task_comms()
    py = []
    for t in threading.enumerate():
        target = getattr(t, "_target", None)
        module = getattr(target, "__module__", None) or type(t).__module__
        py.append((t.name, t.native_id, "" if module == "threading" else module))
    if len(comms) <= 1 and len(py) <= 1:
        return []
    return describe_threads(py, comms, list(sys.modules), threading.main_thread().native_id or os.getpid())


# --- the template -----------------------------------------------------------------


def _preimport(names: Iterable[str]) -> None:
    """Import what every worker imports, so a forked worker only starts serving."""
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # e.g. uvicorn's legacy websockets module
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - optional accelerators (uvloop, httptools) may be missing
                pass


WORKER_MODULES = (
    "numaserve.worker.main", "numaserve.worker.serve", "numaserve.worker.edge", "numaserve.worker.httpproto",
    "numaserve.worker.admission_mw",
    "numaserve.worker.shedding", "numaserve.bind.verify", "numaserve.log",
    "uvicorn.protocols.http.httptools_impl", "uvicorn.protocols.http.h11_impl",
    # ws "auto" (what build_config leaves uvicorn): websockets' sans-I/O protocol, else wsproto; never the
    # legacy websockets_impl, whose import warns about a `--ws websockets` nobody chose
    "uvicorn.protocols.websockets.auto", "uvicorn.protocols.websockets.wsproto_impl",
    "uvicorn.protocols.websockets.websockets_sansio_impl",
    "uvicorn.lifespan.on", "uvicorn.loops.uvloop", "uvloop", "httptools", "zmq", "zmq.asyncio",
)


class RequestLoop:
    """Answer the supervisor's requests on ``sock`` until it closes it (one thread, blocking I/O)."""

    kind = ""
    sock: socket.socket
    log: Any

    def handle(self, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        raise NotImplementedError

    def serve(self) -> int:
        while True:
            try:
                msg, fds = recv_msg(self.sock)
            except ValueError as e:
                self.log.warning(f"{self.kind}_bad_request", error=str(e))
                continue
            except InterruptedError:
                continue
            except OSError as e:
                self.log.error(f"{self.kind}_channel_failed", error=str(e))
                return 1
            if msg is None:
                return 0  # the supervisor closed our channel (replaced us, or is gone)
            try:
                reply = self.handle(msg, fds)
            finally:
                for fd in fds:
                    _close(fd)  # the child has its copies; ours would keep the listener alive
            try:
                send_msg(self.sock, reply)
            except OSError as e:
                self.log.error(f"{self.kind}_channel_failed", error=str(e))
                return 1


class Template(RequestLoop):
    """The template's state and its request loop (one thread, blocking I/O, by design)."""

    kind = "template"

    def __init__(self, spec: TemplateSpec, sock: socket.socket, log: Any) -> None:
        self.spec = spec
        self.sock = sock
        self.log = log
        self.forks = 0

    def boot(self) -> bool:
        """Import the app, run the preload hook, warm the worker's imports; say ready or failed."""
        from numaserve.worker.appload import AppLoadError, load_app, remember_app
        from numaserve.worker.preload import PreloadError, run_preload

        spec = self.spec
        with BootPriority(spec.boot_nice):  # workers forked from here run at the usual priority
            return self._boot(load_app, remember_app, run_preload, (AppLoadError, PreloadError))

    def _boot(self, load_app: Any, remember_app: Any, run_preload: Any, errors: tuple[type, ...]) -> bool:
        from numaserve.progress import LoadBeat

        spec = self.spec
        t0 = time.monotonic()
        # the beat thread is joined before the thread check below: a template forks single-threaded
        try:
            with LoadBeat(LOAD_BEAT_S):
                app = load_app(spec.app, spec.app_dir)
                remember_app(spec.app, spec.app_dir, app)
                t1 = time.monotonic()
                preload_s = run_preload(spec.preload) if spec.preload else 0.0
        except errors as e:
            self.log.error("template_failed", node=spec.node, generation=spec.generation, reason=str(e),
                           exc_info=e.__cause__ is not None)
            send_msg(self.sock, {"t": "failed", "reason": f"app load failed: {e}"})
            return False
        _preimport([*WORKER_MODULES, *spec.preimport])
        gc.collect()
        if spec.gc_freeze:
            gc.freeze()  # imported objects leave the GC's scans: their pages stay shared after fork
        trim_heap()  # the import's freed heap pages go back before any worker maps them in
        threads = current_threads()
        send_msg(self.sock, {"t": "ready", "pid": os.getpid(), "import_s": round(t1 - t0, 4),
                             "preload_s": round(preload_s, 4), "threads": threads})
        self.log.info("template_ready", node=spec.node, generation=spec.generation, pid=os.getpid(),
                      import_s=round(t1 - t0, 3), preload_s=round(preload_s, 3),
                      **({"threads": threads, "fork": "refused: the template has threads"} if threads else {}))
        return True

    def handle(self, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        rid = msg.get("id")
        if msg.get("t") != "fork":
            return {"t": "error", "id": rid, "reason": f"unknown request {msg.get('t')!r}"}
        threads = current_threads()
        if threads:
            return {"t": "refused", "id": rid, "threads": threads,
                    "reason": "the template has threads, forking it is unsafe: " + "; ".join(threads)}
        try:
            spec = msg["spec"]
            token = str(msg["token"])
            env = {str(k): str(v) for k, v in dict(msg["env"]).items()}
            cpus = [int(c) for c in msg["cpus"]]
            reaper = int(msg["reaper"])
            n_fds = 1 + len(spec.get("extra_fds", []))
        except (KeyError, TypeError, ValueError) as e:
            return {"t": "error", "id": rid, "reason": f"bad fork request: {e!r}"}
        if len(fds) != n_fds:
            return {"t": "error", "id": rid, "reason": f"fork request carried {len(fds)} fds, expected {n_fds}"}
        try:
            pid = self._double_fork(spec, token, env, cpus, reaper, fds)
        except OSError as e:
            return {"t": "error", "id": rid, "reason": f"fork failed: {e.strerror or e}"}
        self.forks += 1
        return {"t": "forked", "id": rid, "pid": pid}

    def _double_fork(self, spec: dict[str, Any], token: str, env: dict[str, str], cpus: list[int], reaper: int,
                     fds: list[int]) -> int:
        return double_fork(lambda: _worker_child(self.sock, spec, token, env, cpus, reaper, fds))


def double_fork(child: Callable[[], NoReturn]) -> int:
    """Fork ``child`` as a grandchild and return its pid; the intermediate exits at once.

    The grandchild reparents to the nearest child subreaper (the supervisor), which reaps it.
    """
    r, w = os.pipe()
    try:
        mid = os.fork()
    except BaseException:
        os.close(r)
        os.close(w)
        raise
    if mid == 0:  # intermediate: fork the child, tell its pid, vanish (the child reparents)
        code = 0
        try:
            os.close(r)
            pid = os.fork()
            if pid == 0:
                os.close(w)
                child()
            os.write(w, str(pid).encode())
        except BaseException:  # noqa: BLE001 - never return into the forking process's loop
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    try:
        data = b""
        while chunk := os.read(r, 32):
            data += chunk
    finally:
        os.close(r)
        os.waitpid(mid, 0)
    if not data:
        raise OSError(0, "the intermediate process failed before forking")
    return int(data)


def await_reparent(reaper: int) -> None:
    """Wait until the supervisor (``reaper``) is our parent, then arm the parent-death signal.

    Armed only then: armed earlier, the intermediate's exit would fire it.  Exits the
    process when the supervisor never adopts us or died meanwhile.
    """
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != reaper:  # the intermediate exits right after forking us
        if time.monotonic() > deadline:
            _say(f"not reparented to supervisor pid {reaper} (parent is {os.getppid()}); not starting")
            os._exit(1)
        time.sleep(0.0002)
    from numaserve.bind.launch import set_pdeathsig

    set_pdeathsig(signal.SIGKILL)
    if os.getppid() != reaper:  # the supervisor died between the check and prctl
        os._exit(1)


def set_comm(name: str) -> None:
    """Name this process for ps -o comm, top and /proc/PID/comm (15 bytes): forked processes
    share their zygote's command line, so the name is what tells them apart."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


CAP_SYS_NICE = 23


def can_restore_priority(nice: int, cap_eff: int, rlimit_nice: int) -> bool:
    """Whether a process at ``nice`` that lowers its priority may raise it back (setpriority rules).

    Raising priority needs CAP_SYS_NICE or an RLIMIT_NICE soft limit of at least ``20 - nice``.
    """
    return bool(cap_eff >> CAP_SYS_NICE & 1) or rlimit_nice >= 20 - nice


def _cap_eff(proc: str = "/proc") -> int:
    try:
        with open(f"{proc}/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def lower_priority(by: int) -> int | None:
    """Lower this process's CPU priority by ``by`` nice steps for a while; the nice value to restore.

    None (nothing changed) when ``by`` is 0 or the priority could not be restored afterwards:
    workers forked from a template must not inherit a lowered priority.
    """
    if by <= 0:
        return None
    import resource

    try:
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        if not can_restore_priority(nice, _cap_eff(), resource.getrlimit(resource.RLIMIT_NICE)[0]):
            return None
        os.setpriority(os.PRIO_PROCESS, 0, min(19, nice + by))
    except OSError:
        return None
    return nice


#: How long a boot that yields to serving workers may run at SCHED_IDLE (only on CPU time they
#: leave) before it falls back to ``nice +boot_nice``, so a saturated node still gets its template.
BOOT_IDLE_S = 0.1

#: How often a loading template stamps its progress file (``numaserve.progress.LoadBeat``):
#: well inside any supervisor.heartbeat_timeout (which must exceed heartbeat_interval).
LOAD_BEAT_S = 0.5


class BootPriority:
    """Run a boot (a template's app import, a zygote's imports) on the CPU serving workers leave.

    Why: during a reload the new generation imports the app on the same CPUs as the workers
    that serve; at ``nice +10`` it still takes ~10 % of a busy CPU, visible as a dip in the
    served rate.  ``SCHED_IDLE`` runs it only when a CPU would otherwise idle, which a closed
    loop of real clients leaves (network waits, new connections).  Bounded: after
    ``idle_s`` (a SIGALRM timer: a template must not start a thread) it falls back to
    ``nice +by``, so a node with no idle time still gets its template.  Nothing changes when
    ``by`` is 0 or the priority could not be restored afterwards (``lower_priority``):
    whatever is forked after the boot runs at the usual priority.  The supervisor also ends
    the idle phase from outside (``TemplateManager._bound_boot_idle``): a starved process runs its
    own signal handler late.
    """

    def __init__(self, by: int, idle_s: float = BOOT_IDLE_S) -> None:
        self.by = by
        self.idle_s = idle_s
        self.restore_nice: int | None = None
        self.idle = False
        self._old_alarm: Any = None

    def __enter__(self) -> BootPriority:
        self.restore_nice = lower_priority(self.by)
        if self.restore_nice is None or self.idle_s <= 0 or not hasattr(os, "SCHED_IDLE"):
            return self
        try:
            if os.sched_getscheduler(0) != os.SCHED_OTHER:
                return self  # an operator's real-time or batch policy is theirs: leave it
            self._old_alarm = signal.signal(signal.SIGALRM, self._leave_idle)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            self.idle = True
            signal.setitimer(signal.ITIMER_REAL, self.idle_s)
        except (OSError, ValueError):
            self._leave_idle()
        return self

    def _leave_idle(self, *_: Any) -> None:
        if self.idle:
            try:
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass
            self.idle = False

    def __exit__(self, *_: object) -> None:
        if self._old_alarm is not None:
            if signal.getsignal(signal.SIGALRM) == self._leave_idle:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, self._old_alarm)
            # else the app's import installed its own SIGALRM handler (and maybe a timer): theirs
            self._leave_idle()
            self._old_alarm = None
        if self.restore_nice is not None:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, self.restore_nice)
            except OSError:
                pass


def _worker_child(chan: socket.socket, spec_obj: dict[str, Any], token: str, env: dict[str, str],
                  cpus: list[int], reaper: int, fds: list[int]) -> NoReturn:
    """The forked worker: narrow, reparent, take the slot's identity, serve.  Never returns."""
    code = 1
    try:
        chan.close()
        os.setpgid(0, 0)  # its own process group, as an exec'd worker has
        set_comm(f"ns-worker-{spec_obj.get('slot')}")
        if cpus:
            os.sched_setaffinity(0, cpus)  # before any thread exists: every thread inherits it
        await_reparent(reaper)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        replace_environ(env)
        import msgspec

        from numaserve.worker.main import run_worker
        from numaserve.worker.spec import SPEC_ENV, WorkerSpec

        spec_obj = dict(spec_obj, fd=fds[0], extra_fds=list(fds[1:]))
        spec = msgspec.convert(spec_obj, WorkerSpec)
        os.environ[SPEC_ENV] = msgspec.json.encode(spec).decode()
        for fd in fds:
            os.set_inheritable(fd, True)  # as an exec'd worker has them (a child it execs may need them)
        code = run_worker(spec, token)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:  # noqa: BLE001
        _say(f"forked worker failed: {type(e).__name__}: {e}")
        code = 1
    finally:
        child_exit(code)


def replace_environ(env: Mapping[str, str], environ: MutableMapping[str, str] | None = None) -> None:
    """Make ``environ`` (``os.environ``) exactly ``env``, changing only the variables that differ.

    Why not ``clear()`` + ``update()``: in a forked child that frees every inherited
    key and value and allocates them again, and each free writes to the page the
    object sits on, a page shared with the template until then: ~0.3 MB more
    private memory in every forked worker (``/proc/PID/smaps_rollup``), for an
    environment that is mostly the same as the template's.
    """
    target = os.environ if environ is None else environ
    for key in [k for k in target if k not in env]:
        del target[key]
    for key, value in env.items():
        if target.get(key) != value:
            target[key] = value


def child_exit(code: int) -> NoReturn:
    """End a forked child: flush what it wrote, never run the parent's atexit/finally code."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def _say(msg: str) -> None:
    try:
        sys.stderr.write(json.dumps({"event": "template_child", "level": "error", "error": msg}) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def main() -> int:
    try:
        spec = TemplateSpec.from_env()
    except (RuntimeError, ValueError, TypeError) as e:
        _say(f"bad template spec: {e}")
        return 1
    os.environ.pop(TEMPLATE_SPEC_ENV, None)  # forked workers get their own environment anyway
    return run_template(spec)


def run_template(spec: TemplateSpec) -> int:
    """A template's life once it has its spec: exec'd (``main``) or forked by its node's zygote."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor orchestrates; Ctrl-C hits it
    set_comm(f"ns-template-{spec.node}")
    from numaserve.log import configure_logging, get_logger

    configure_logging(spec.log_level, spec.log_format,
                      stream=sys.stderr, process=f"template-{spec.node}")
    log = get_logger("numaserve.template").bind(node=spec.node, generation=spec.generation)
    sock = socket.socket(fileno=spec.control_fd)
    template = Template(spec, sock, log)
    if not template.boot():
        return EXIT_TEMPLATE_FAILED
    return template.serve()


if __name__ == "__main__":
    sys.exit(main())
