"""A node's zygote: numaserve's worker stack imported, the app not; forks each template generation.

A reload must load the app's new code, so its template generation cannot be
forked from the current template (modules already imported there would not
be imported again; pruning the app's packages out of ``sys.modules`` misses
whatever else holds on to the old objects: registries, C extensions,
``functools`` caches).  What a reload does not need to redo is the rest: a
fresh interpreter importing numaserve's worker stack (uvicorn's protocols,
uvloop, httptools, ZeroMQ's bindings, msgspec, structlog), most of a
template's start-up.  The zygote is that interpreter, started once per node
through the exec trampoline like a template (node CPUs, memory policy), and it
*never imports the app*: every template generation it forks imports the app
afresh, so a reload pays the app's import (and preload hook) only.

Control channel and wire as for templates (``numaserve.worker.template``):

    zygote → supervisor   {"t": "ready", pid, import_s, threads}
    supervisor → zygote   {"t": "template", id, spec, env, cwd, reaper} + the template's channel fd
    zygote → supervisor   {"t": "forked", id, pid} | {"t": "refused", id, reason, threads}
                          | {"t": "error", id, reason}

The template is double-forked, so it is the supervisor's child (a child
subreaper) like an exec'd one; it takes its own environment, working
directory and process group, then runs the template's normal life
(``numaserve.worker.template.run_template``).  What the zygote imported is
never re-imported: a reload after *upgrading numaserve or its dependencies*
runs the old copies (as the supervisor itself does) until a restart.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
import sys
import time
from typing import Any, NoReturn

from numaserve.worker.template import (
    WORKER_MODULES,
    EnvSpec,
    RequestLoop,
    TemplateSpec,
    _preimport,
    _say,
    await_reparent,
    child_exit,
    current_threads,
    double_fork,
    replace_environ,
    run_template,
    send_msg,
    set_comm,
    trim_heap,
)

__all__ = ["ZYGOTE_SPEC_ENV", "Zygote", "ZygoteSpec", "main"]

ZYGOTE_SPEC_ENV = "NUMASERVE_ZYGOTE_SPEC"


class ZygoteSpec(EnvSpec):
    """What the supervisor tells a zygote at start (JSON in ``NUMASERVE_ZYGOTE_SPEC``)."""

    ENV = ZYGOTE_SPEC_ENV
    WHAT = "zygotes"

    def __init__(self, *, node: int, control_fd: int, log_level: str = "info", log_format: str = "json",
                 gc_freeze: bool = True, boot_nice: int = 0) -> None:
        self.node = node
        self.control_fd = control_fd
        self.log_level = log_level
        self.log_format = log_format
        self.gc_freeze = gc_freeze
        self.boot_nice = int(boot_nice)


class Zygote(RequestLoop):
    """The zygote's request loop (one thread, blocking I/O, like a template's)."""

    kind = "zygote"

    def __init__(self, spec: ZygoteSpec, sock: socket.socket, log: Any) -> None:
        self.spec = spec
        self.sock = sock
        self.log = log
        self.forks = 0

    def boot(self) -> None:
        from numaserve.worker.template import BootPriority

        t0 = time.monotonic()
        with BootPriority(self.spec.boot_nice):
            _preimport(WORKER_MODULES)
        gc.collect()
        if self.spec.gc_freeze:
            gc.freeze()
        trim_heap()  # free heap pages back to the kernel before a template copies them on write
        threads = current_threads()
        import_s = round(time.monotonic() - t0, 4)
        send_msg(self.sock, {"t": "ready", "pid": os.getpid(), "import_s": import_s, "threads": threads})
        self.log.info("zygote_ready", node=self.spec.node, pid=os.getpid(), import_s=round(import_s, 3),
                      **({"threads": threads} if threads else {}))

    def handle(self, msg: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        rid = msg.get("id")
        if msg.get("t") != "template":
            return {"t": "error", "id": rid, "reason": f"unknown request {msg.get('t')!r}"}
        threads = current_threads()
        if threads:
            return {"t": "refused", "id": rid, "threads": threads,
                    "reason": "the zygote has threads, forking it is unsafe: " + "; ".join(threads)}
        try:
            spec = dict(msg["spec"])
            env = {str(k): str(v) for k, v in dict(msg["env"]).items()}
            cwd = str(msg.get("cwd") or "")
            reaper = int(msg["reaper"])
        except (KeyError, TypeError, ValueError) as e:
            return {"t": "error", "id": rid, "reason": f"bad template request: {e!r}"}
        if len(fds) != 1:
            return {"t": "error", "id": rid, "reason": f"template request carried {len(fds)} fds, expected 1"}
        try:
            pid = double_fork(lambda: _template_child(self.sock, spec, env, cwd, reaper, fds[0]))
        except OSError as e:
            return {"t": "error", "id": rid, "reason": f"fork failed: {e.strerror or e}"}
        self.forks += 1
        return {"t": "forked", "id": rid, "pid": pid}


def _template_child(chan: socket.socket, spec_obj: dict[str, Any], env: dict[str, str], cwd: str, reaper: int,
                    fd: int) -> NoReturn:
    """The forked template: reparent, take its environment, import the app, serve forks.  Never returns."""
    code = 1
    try:
        chan.close()
        os.setpgid(0, 0)  # its own process group, as an exec'd template has
        await_reparent(reaper)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        replace_environ(env)
        if cwd:
            os.chdir(cwd)
        spec = TemplateSpec(**dict(spec_obj, control_fd=fd))
        code = run_template(spec)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:  # noqa: BLE001
        why = f"forked template failed: {type(e).__name__}: {e}"
        _say(why)
        try:  # the supervisor reads why on the template's own channel (it is not running yet)
            send_msg(socket.socket(fileno=fd), {"t": "failed", "reason": why})
        except OSError:
            pass
        code = 1
    finally:
        child_exit(code)


def main() -> int:
    try:
        spec = ZygoteSpec.from_env()
    except (RuntimeError, ValueError, TypeError) as e:
        _say(f"bad zygote spec: {e}")
        return 1
    os.environ.pop(ZYGOTE_SPEC_ENV, None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_comm(f"ns-zygote-{spec.node}")
    from numaserve.log import configure_logging, get_logger

    configure_logging(spec.log_level, spec.log_format, stream=sys.stderr, process=f"zygote-{spec.node}")
    log = get_logger("numaserve.zygote").bind(node=spec.node)
    zygote = Zygote(spec, socket.socket(fileno=spec.control_fd), log)
    zygote.boot()
    return zygote.serve()


if __name__ == "__main__":
    sys.exit(main())
