"""configure_logging: JSON lines off a tty, console on one, stdlib routed, levels, idempotence."""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
import structlog

from numaserve.log import configure_logging, get_logger


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)
    structlog.reset_defaults()


def records(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_when_not_a_tty() -> None:
    s = io.StringIO()
    configure_logging("info", "auto", stream=s, process="worker-2")
    get_logger("numaserve.test").bind(slot=2).info("worker_ready", generation=3, cpus=[0, 1])
    (rec,) = records(s)
    assert rec["event"] == "worker_ready"
    assert rec["level"] == "info"
    assert rec["logger"] == "numaserve.test"
    assert rec["pid"] == os.getpid()
    assert rec["process"] == "worker-2"
    assert rec["slot"] == 2 and rec["generation"] == 3 and rec["cpus"] == [0, 1]
    ts = datetime.fromisoformat(str(rec["timestamp"]).replace("Z", "+00:00"))
    assert ts.utcoffset() == timedelta(0)
    assert "\x1b[" not in s.getvalue()


def test_explicit_json_even_on_a_tty() -> None:
    s = TtyStream()
    configure_logging("info", "json", stream=s)
    get_logger("x").info("hello")
    assert records(s)[0]["event"] == "hello"


def test_stdlib_logging_is_routed_through_the_same_renderer() -> None:
    uvicorn_err = logging.getLogger("uvicorn.error")
    uvicorn_err.addHandler(logging.StreamHandler(io.StringIO()))  # as uvicorn's own config would
    uvicorn_err.propagate = False
    s = io.StringIO()
    configure_logging("info", "json", stream=s)
    uvicorn_err.warning("Started server process [%d]", 42)
    logging.getLogger("asyncio").error("Task was destroyed")
    recs = records(s)
    assert [(r["logger"], r["level"], r["event"]) for r in recs] == [
        ("uvicorn.error", "warning", "Started server process [42]"),
        ("asyncio", "error", "Task was destroyed"),
    ]
    assert all(r["pid"] == os.getpid() and "timestamp" in r for r in recs)


def test_level_filter_applies_to_structlog_and_stdlib() -> None:
    s = io.StringIO()
    configure_logging("warning", "json", stream=s)
    log = get_logger("numaserve.x")
    log.debug("d")
    log.info("i")
    log.warning("w")
    logging.getLogger("uvicorn.access").info("GET / 200")
    logging.getLogger("lib").error("e")
    assert [r["event"] for r in records(s)] == ["w", "e"]


def test_debug_level_shows_debug() -> None:
    s = io.StringIO()
    configure_logging("DEBUG", "json", stream=s)
    get_logger("x").debug("dbg", n=1)
    assert records(s)[0]["level"] == "debug"


def test_idempotent_no_duplicate_lines() -> None:
    s1, s2 = io.StringIO(), io.StringIO()
    configure_logging("info", "json", stream=s1)
    configure_logging("info", "json", stream=s2)
    configure_logging("info", "json", stream=s2)
    get_logger("x").info("once")
    logging.getLogger("y").info("stdlib once")
    assert s1.getvalue() == ""
    assert [r["event"] for r in records(s2)] == ["once", "stdlib once"]
    ours = [h for h in logging.getLogger().handlers if getattr(h, "_numaserve_handler", False)]
    assert len(ours) == 1


def test_exceptions_are_one_json_line() -> None:
    s = io.StringIO()
    configure_logging("info", "json", stream=s)
    try:
        raise ValueError("bad thing")
    except ValueError:
        get_logger("x").exception("failed")
    (rec,) = records(s)
    assert rec["level"] == "error"
    assert "ValueError: bad thing" in str(rec["exception"])


def test_console_on_a_tty_has_colours(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    s = TtyStream()
    configure_logging("info", "auto", stream=s)
    get_logger("x").info("hello", slot=1)
    out = s.getvalue()
    assert "hello" in out and "\x1b[" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.splitlines()[0])


def test_no_colour_with_no_color_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    s = TtyStream()
    configure_logging("info", "console", stream=s)
    get_logger("x").info("hello")
    assert "hello" in s.getvalue() and "\x1b[" not in s.getvalue()


def test_console_format_never_colours_a_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    s = io.StringIO()
    configure_logging("info", "console", stream=s)
    log = get_logger("x")
    log.info("plain", slot=1)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("oops")
    logging.getLogger("uvicorn.error").warning("from stdlib")
    out = s.getvalue()
    assert "plain" in out and "slot=1" in out and "from stdlib" in out and "RuntimeError: boom" in out
    assert "\x1b[" not in out


@pytest.mark.parametrize("level,fmt", [("loud", "auto"), ("info", "xml")])
def test_bad_arguments(level: str, fmt: str) -> None:
    with pytest.raises(ValueError):
        configure_logging(level, fmt, stream=io.StringIO())


def test_default_stream_is_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "json")
    get_logger("x").info("to stderr")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert json.loads(captured.err.splitlines()[-1])["event"] == "to stderr"


def test_a_library_warning_is_a_json_record_too() -> None:
    import warnings

    s = io.StringIO()
    configure_logging("warning", "json", stream=s)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("the `websockets` implementation is deprecated", UserWarning, stacklevel=1)
    finally:
        logging.captureWarnings(False)
    (rec,) = records(s)
    assert rec["logger"] == "py.warnings" and rec["level"] == "warning"
    assert "UserWarning: the `websockets` implementation is deprecated" in str(rec["event"])
