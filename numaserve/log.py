"""Logging for the supervisor and workers: JSON lines for journald/files, console for a tty.

One ``configure_logging`` call sets up structlog *and* the stdlib root logger
with the same renderer, so uvicorn, asyncio and library warnings come out in
the same format as numaserve's own events.  JSON lines (one object per line,
ISO-8601 UTC timestamp) are what journald, Loki and ``jq`` want; the coloured
console renderer is only for a human at a terminal and never writes ANSI
escapes to anything that is not one.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, MutableMapping, TextIO

import structlog

__all__ = ["configure_logging", "get_logger", "LEVELS", "FORMATS"]

LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
FORMATS = ("auto", "json", "console")

# Loggers that install their own handlers; we send them through the root one.
_ROUTED_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "asyncio", "py.warnings")
_HANDLER_MARK = "_numaserve_handler"


def _rich_traceback(sio: TextIO, exc_info: Any) -> None:
    """A coloured traceback for a terminal (rich is imported here, not by every process at start)."""
    try:
        from rich.console import Console
        from rich.traceback import Traceback
    except ImportError:
        structlog.dev.plain_traceback(sio, exc_info)
        return
    sio.write("\n")
    Console(file=sio, color_system="truecolor", width=100).print(
        Traceback.from_exception(*exc_info, show_locals=False))


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _add_process(process: str) -> structlog.types.Processor:
    """Processor adding ``pid`` (read per event: it changes after fork) and ``process``."""

    def add(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        event_dict.setdefault("pid", os.getpid())
        event_dict.setdefault("process", process)
        return event_dict

    return add


# Event sinks: callables that get a copy of every structured event (after
# level filtering) — the supervisor forwards its lifecycle events to the
# ZeroMQ PUB stream this way, so the stream and the journal carry the same
# records without each call site publishing twice.
_SINKS: list[Any] = []


def add_event_sink(sink: Any) -> None:
    if sink not in _SINKS:
        _SINKS.append(sink)


def remove_event_sink(sink: Any) -> None:
    if sink in _SINKS:
        _SINKS.remove(sink)


def _to_sinks(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for sink in list(_SINKS):
        try:
            sink(dict(event_dict))
        except Exception:  # a broken sink must never break logging
            pass
    return event_dict


def configure_logging(
    level: str = "info",
    fmt: str = "auto",
    *,
    stream: TextIO | None = None,
    process: str = "supervisor",
) -> None:
    """Configure structlog and stdlib logging to write to ``stream`` (default stderr).

    ``fmt``: "json" (one JSON object per line), "console" (readable; colours
    only on a tty), or "auto" = console on a tty, JSON otherwise — under
    systemd stderr goes to journald, which wants one record per line.
    ``process`` names the emitter ("supervisor", "worker-3") in every record.
    Idempotent: a second call replaces the handler installed by the first.
    """
    lvl = level.lower() if isinstance(level, str) else level
    if lvl not in LEVELS:
        raise ValueError(f"log level {level!r}: expected one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    out = sys.stderr if stream is None else stream
    tty = _is_tty(out)
    use_json = fmt == "json" or (fmt == "auto" and not tty)

    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        _add_process(process),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    final: list[structlog.types.Processor]
    if use_json:
        final = [
            structlog.processors.format_exc_info,
            structlog.processors.UnicodeDecoder(),
            structlog.processors.JSONRenderer(default=str),
        ]
    else:
        colors = tty and "NO_COLOR" not in os.environ
        renderer = structlog.dev.ConsoleRenderer(
            colors=colors,
            exception_formatter=_rich_traceback if colors else structlog.dev.plain_traceback,
        )
        final = [renderer]

    # under systemd: the same lines through journald's native protocol, with fields
    from numaserve.journald import journal_handler, stash_event

    journal = journal_handler(out)
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[*([stash_event] if journal else []),
                    structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    handler: logging.StreamHandler = journal or logging.StreamHandler(out)  # type: ignore[type-arg]
    handler.setFormatter(formatter)
    setattr(handler, _HANDLER_MARK, True)

    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, _HANDLER_MARK, False):
            root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(LEVELS[lvl])
    # a library's warnings.warn() goes through the log as well (logger py.warnings), never as
    # bare text on stderr between JSON lines (off first: re-installed even when something restored
    # warnings.showwarning since an earlier call)
    logging.captureWarnings(False)
    logging.captureWarnings(True)
    for name in _ROUTED_LOGGERS:
        lg = logging.getLogger(name)
        lg.handlers.clear()
        lg.propagate = True
        lg.setLevel(logging.NOTSET)

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            _to_sinks,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger named ``name`` (shown as ``logger`` in every record)."""
    return structlog.stdlib.get_logger(name)
