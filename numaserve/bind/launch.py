"""Exec trampoline: bind CPU + memory, arm the parent-death signal, then execvp.

Why a trampoline: the kernel applies CPU affinity and memory policy per
*thread*, and only threads created afterwards inherit them.  Binding from
inside a worker after its interpreter started is too late (threads exist,
pages are touched); ``Popen(preexec_fn=...)`` is unsafe in a threaded parent.
This file runs as its own tiny single-threaded process::

    python -I -S /path/to/numaserve/launch.py --cpus 2-3 --mempolicy bind \\
        --nodes 1 --pdeathsig SIGKILL --ppid 1234 -- PROGRAM ARGS...

binds, then ``execvp``s PROGRAM, so every thread and allocation of the new
image is bound from its first instruction.  Stdlib only and no numaserve
imports when run as a file (``-I -S``: fast start); the syscall code lives in
``numa.py`` beside it, loaded by file path.  On failure: one line
``numaserve-launch: <what failed>: <reason>`` on stderr, exit 126 (127 when
PROGRAM is not found).  ``build_launch_argv`` builds the command for callers.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # no typing import at run time (start-up budget)
    from types import ModuleType
    from typing import Iterable, NoReturn, Sequence

__all__ = [
    "LAUNCH_EXIT_BIND_FAILED",
    "LAUNCH_EXIT_NOT_FOUND",
    "LAUNCHER_PATH",
    "LaunchError",
    "build_launch_argv",
    "bind",
    "set_pdeathsig",
    "restore_signals",
    "exec_program",
    "main",
]

LAUNCH_EXIT_BIND_FAILED = 126
LAUNCH_EXIT_NOT_FOUND = 127
LAUNCHER_PATH = os.path.abspath(__file__)
PROG = "numaserve-launch"
_PR_SET_PDEATHSIG = 1
_POLICIES = ("bind", "preferred", "interleave", "local", "default")

USAGE = (
    f"usage: {PROG} [--cpus LIST] [--mempolicy {'|'.join(_POLICIES)}] [--nodes LIST] "
    "[--no-static] [--pdeathsig SIGNAME] [--ppid PID] [--chdir DIR] -- PROGRAM [ARGS...]"
)


class LaunchError(Exception):
    """A step of the launch failed; ``what`` names the step, ``exit_code`` is 126/127."""

    def __init__(self, what: str, reason: str, exit_code: int = LAUNCH_EXIT_BIND_FAILED) -> None:
        super().__init__(f"{what}: {reason}")
        self.what = what
        self.reason = reason
        self.exit_code = exit_code


def _numa() -> ModuleType:
    """numaserve.bind.numa when imported as a package module, else numa.py by file path."""
    if __package__:
        from numaserve.bind import numa

        return numa
    mod = sys.modules.get("_numaserve_numa")
    if mod is None:
        from importlib.machinery import SourceFileLoader

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "numa.py")
        loader = SourceFileLoader("_numaserve_numa", path)
        mod = type(sys)("_numaserve_numa")
        mod.__file__ = path
        mod.__loader__ = loader
        sys.modules["_numaserve_numa"] = mod
        loader.exec_module(mod)
    return mod


def _signals() -> ModuleType:
    try:
        import _signal  # the C module: no enum import (~5 ms)

        return _signal
    except ImportError:  # pragma: no cover - other interpreters
        import signal

        return signal


def parse_signal(name: str) -> int:
    """Signal name or number ("SIGKILL", "KILL", "term", "9") → number; "0"/"none" → 0 (off)."""
    s = name.strip()
    if s.lower() in ("", "0", "none"):
        return 0
    if s.isdigit():
        return int(s)
    up = s.upper()
    if not up.startswith("SIG"):
        up = "SIG" + up
    num = getattr(_signals(), up, None)
    if not isinstance(num, int) or up.startswith("SIG_"):
        raise ValueError(f"unknown signal {name!r}")
    return num


def bind(
    cpus: Iterable[int] | None, mempolicy: str | None, nodes: Iterable[int] = (), *, static: bool = True
) -> None:
    """CPU affinity, then memory policy, of the calling thread; LaunchError on failure.

    ``None`` leaves that part as inherited.
    """
    numa = _numa()
    node_list = list(nodes)
    if cpus is not None:
        try:
            numa.set_cpu_affinity(cpus)
        except (OSError, ValueError) as e:
            raise LaunchError(*_split(e, "cpu affinity")) from None
    if mempolicy is None:
        return
    try:
        numa.set_mempolicy(mempolicy, node_list if mempolicy not in ("local", "default") else (), static=static)
    except (OSError, ValueError) as e:
        raise LaunchError(*_split(e, "memory policy")) from None


def set_pdeathsig(sig: int) -> None:
    """prctl(PR_SET_PDEATHSIG): the kernel sends ``sig`` when our parent *thread* exits.

    Survives execve (except set-uid/capability-gaining binaries).
    """
    import ctypes

    libc = _numa().load_libc()
    if libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(sig), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        raise LaunchError("prctl(PR_SET_PDEATHSIG)", os.strerror(err))


def restore_signals() -> None:
    """Undo CPython's start-up SIG_IGN of SIGPIPE/SIGXFSZ (ignored dispositions
    survive execve; subprocess does the same with restore_signals=True)."""
    sig = _signals()
    for name in ("SIGPIPE", "SIGXFSZ", "SIGXFZ"):
        num = getattr(sig, name, None)
        if num is not None:
            try:
                sig.signal(num, sig.SIG_DFL)
            except (OSError, ValueError):
                pass


def exec_program(argv: Sequence[str]) -> NoReturn:
    """execvp(argv[0], argv); LaunchError 127 when not found, 126 otherwise."""
    if not argv:
        raise LaunchError("usage", "no PROGRAM given after --")
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()  # exec drops Python's buffers
        except (OSError, ValueError):
            pass
    try:
        os.execvp(argv[0], list(argv))
    except FileNotFoundError:
        raise LaunchError(f"exec {argv[0]}", "command not found", LAUNCH_EXIT_NOT_FOUND) from None
    except OSError as e:
        raise LaunchError(f"exec {argv[0]}", e.strerror or str(e)) from None


def build_launch_argv(
    argv: Sequence[str],
    *,
    cpus: Iterable[int] | None,
    mempolicy: str,
    nodes: Iterable[int],
    static: bool = True,
    pdeathsig: str | None = "SIGKILL",
    ppid: int | None = None,
    python: str = sys.executable,
    chdir: str | None = None,
) -> list[str]:
    """The command that runs ``argv`` bound via this trampoline.

    ``ppid=None`` with a ``pdeathsig`` means "the calling process" (the usual
    case: the caller spawns the launcher directly); ``ppid=0`` skips the check.
    """
    argv = list(argv)
    if not argv:
        raise ValueError("build_launch_argv: empty argv")
    if mempolicy not in _POLICIES:
        raise ValueError(f"build_launch_argv: unknown mempolicy {mempolicy!r} (use {', '.join(_POLICIES)})")
    node_list = sorted({int(n) for n in nodes})
    if mempolicy in ("bind", "preferred", "interleave") and not node_list:
        raise ValueError(f"build_launch_argv: mempolicy {mempolicy} needs nodes")
    out = [python, "-I", "-S", LAUNCHER_PATH]
    if cpus is not None:
        cpu_list = sorted({int(c) for c in cpus})
        if not cpu_list:
            raise ValueError("build_launch_argv: empty cpus (use None for no CPU binding)")
        out += ["--cpus", _numa().format_list(cpu_list)]
    out += ["--mempolicy", mempolicy]
    if node_list and mempolicy not in ("local", "default"):
        out += ["--nodes", _numa().format_list(node_list)]
    if not static:
        out.append("--no-static")
    if pdeathsig:
        parse_signal(pdeathsig)  # fail here, not in the child
        out += ["--pdeathsig", pdeathsig]
        if ppid is None:
            ppid = os.getpid()
    if ppid:
        out += ["--ppid", str(int(ppid))]
    if chdir is not None:
        out += ["--chdir", chdir]
    return out + ["--"] + argv


class _Opts:
    cpus: tuple[int, ...] | None = None
    mempolicy: str | None = None  # None: keep the inherited policy
    nodes: tuple[int, ...] = ()
    static = True
    pdeathsig = 0
    ppid: int | None = None
    chdir: str | None = None
    program: list[str]


def parse_args(args: Sequence[str]) -> _Opts:
    """Hand-rolled (argparse costs ~10 ms at start); LaunchError("usage", ...) on error."""
    numa = _numa()
    o = _Opts()
    i = 0
    args = list(args)
    with_value = ("--cpus", "--mempolicy", "--nodes", "--pdeathsig", "--ppid", "--chdir")
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-"):
            break
        key, eq, val = a.partition("=")
        if key in with_value:
            if not eq:
                if i + 1 >= len(args):
                    raise LaunchError("usage", f"{key} needs a value")
                val = args[i + 1]
                i += 1
            try:
                if key == "--cpus":
                    o.cpus = numa.parse_list(val)
                    if not o.cpus:
                        raise ValueError("empty CPU list")
                elif key == "--nodes":
                    o.nodes = numa.parse_list(val)
                elif key == "--mempolicy":
                    if val not in _POLICIES:
                        raise ValueError(f"must be one of {', '.join(_POLICIES)}")
                    o.mempolicy = val
                elif key == "--pdeathsig":
                    o.pdeathsig = parse_signal(val)
                elif key == "--ppid":
                    o.ppid = int(val)
                else:
                    o.chdir = val
            except ValueError as e:
                raise LaunchError("usage", f"{key} {val!r}: {e}") from None
        elif key == "--no-static" and not eq:
            o.static = False
        elif key in ("-h", "--help"):
            raise LaunchError("usage", USAGE, 0)
        else:
            raise LaunchError("usage", f"unknown option {a!r}")
        i += 1
    o.program = args[i:]
    if not o.program:
        raise LaunchError("usage", "no PROGRAM given after --")
    if o.mempolicy in ("bind", "preferred", "interleave") and not o.nodes:
        raise LaunchError("usage", f"--mempolicy {o.mempolicy} needs --nodes")
    return o


def run(o: _Opts) -> NoReturn:
    """Apply everything in ``o`` to this process, then exec its program."""
    if o.pdeathsig:
        set_pdeathsig(o.pdeathsig)
    bind(o.cpus, o.mempolicy, o.nodes, static=o.static)
    if o.chdir is not None:
        try:
            os.chdir(o.chdir)
        except OSError as e:
            raise LaunchError(f"chdir {o.chdir}", e.strerror or str(e)) from None
    if o.ppid is not None and os.getppid() != o.ppid:
        # The parent died before PR_SET_PDEATHSIG was armed: act as if it fired.
        if o.pdeathsig:
            os.kill(os.getpid(), o.pdeathsig)
        raise LaunchError("parent check", f"parent {o.ppid} is gone (now {os.getppid()}); not starting")
    restore_signals()
    exec_program(o.program)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns an exit status only on failure (success execs)."""
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except LaunchError as e:
        if e.exit_code == 0:
            sys.stdout.write(e.reason + "\n")
            return 0
        _say(f"{e.what}: {e.reason}")
        return e.exit_code


def _split(e: BaseException, default_what: str) -> tuple[str, str]:
    """numa.py messages read "call(args): reason"; keep the call as *what*."""
    msg = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    what, sep, reason = msg.partition("): ")
    if sep and "(" in what and " " not in what.split("(", 1)[0]:
        return what + ")", reason
    return default_what, msg


def _say(msg: str) -> None:
    try:
        sys.stderr.write(f"{PROG}: {msg}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
