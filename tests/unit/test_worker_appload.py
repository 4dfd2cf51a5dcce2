"""Loading the served app from "module:attr" / "module:factory()"."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any, Iterator

import pytest

from numaserve.apps import demo
from numaserve.worker.appload import (
    AppLoadError,
    describe_exception,
    failure_line,
    load_app,
)

APP_SOURCE = textwrap.dedent('''
    class Holder:
        async def inner(self, scope, receive, send):
            pass

    holder = Holder()

    async def app(scope, receive, send):
        pass

    def make():
        return app

    def broken_factory():
        raise RuntimeError("db down\\ndetails")

    def asgi2(scope):
        async def instance(receive, send):
            pass
        return instance

    not_callable = 42
''')


@pytest.fixture
def app_dir(tmp_path: Path) -> Iterator[str]:
    name = f"nsw_app_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(APP_SOURCE)
    (tmp_path / "nsw_raises_exit.py").write_text("raise SystemExit(2)\n")
    (tmp_path / "nsw_syntax.py").write_text("def broken(:\n")
    saved = list(sys.path)
    yield name
    sys.path[:] = saved
    for mod in (name, "nsw_raises_exit", "nsw_syntax"):
        sys.modules.pop(mod, None)


def test_default_is_demo() -> None:
    assert load_app("") is demo.app
    assert load_app("  ") is demo.app


def test_attr_factory_and_nested(tmp_path: Path, app_dir: str) -> None:
    mod = load_app(f"{app_dir}:app", str(tmp_path))
    assert sys.path[0] == str(tmp_path)
    assert load_app(f"{app_dir}:make()", str(tmp_path)) is mod
    bound = load_app(f"{app_dir}:holder.inner", str(tmp_path))
    assert bound.__name__ == "inner"


def test_asgi2_app_is_adapted(tmp_path: Path, app_dir: str) -> None:
    from uvicorn.middleware.asgi2 import ASGI2Middleware

    assert isinstance(load_app(f"{app_dir}:asgi2", str(tmp_path)), ASGI2Middleware)


@pytest.mark.parametrize("ref, expected", [
    ("nosuchmod_xyz:app", "ModuleNotFoundError: No module named 'nosuchmod_xyz' (importing 'nosuchmod_xyz')"),
    ("{mod}:missing", "AttributeError: module '{mod}' has no attribute 'missing'"),
    ("{mod}:broken_factory()", "RuntimeError: db down (calling factory '{mod}:broken_factory()')"),
    ("{mod}:not_callable", "TypeError: '{mod}:not_callable' is a int, not an ASGI callable"),
    ("nocolon", "ValueError: bad app reference 'nocolon': expected 'module:attr' or 'module:factory()'"),
    ("mod:", "ValueError: bad app reference 'mod:': expected 'module:attr' or 'module:factory()'"),
    ("nsw_raises_exit:app", "SystemExit: 2 (importing 'nsw_raises_exit')"),
])
def test_failures_are_one_line(tmp_path: Path, app_dir: str, ref: str, expected: str) -> None:
    with pytest.raises(AppLoadError) as info:
        load_app(ref.format(mod=app_dir), str(tmp_path))
    assert str(info.value) == expected.format(mod=app_dir)
    assert "\n" not in str(info.value)


def test_syntax_error_is_one_line(tmp_path: Path, app_dir: str) -> None:
    with pytest.raises(AppLoadError, match=r"^SyntaxError: ") as info:
        load_app("nsw_syntax:app", str(tmp_path))
    assert "\n" not in str(info.value)


def test_describe_exception() -> None:
    assert describe_exception(ValueError("a\nb")) == "ValueError: a"
    assert describe_exception(KeyError()) == "KeyError"
    assert describe_exception(RuntimeError("   ")) == "RuntimeError"


# --- failure_line: the one line of a failure message ---------------------------------


def formatted(fn: Any) -> str:
    import traceback

    try:
        fn()
    except BaseException:
        return traceback.format_exc()
    raise AssertionError("did not raise")


def test_failure_line_takes_the_exception_out_of_a_traceback() -> None:
    def missing_file() -> None:
        open("/nonexistent/model.bin")

    text = formatted(missing_file)
    assert text.startswith("Traceback (most recent call last):")
    assert failure_line(text) == "FileNotFoundError: [Errno 2] No such file or directory: '/nonexistent/model.bin'"


def test_failure_line_of_a_chained_exception_is_the_last_raised() -> None:
    def chained() -> None:
        try:
            {}["model"]
        except KeyError as e:
            raise RuntimeError("config has no model:\n  set [model] path") from e

    assert failure_line(formatted(chained)) == "RuntimeError: config has no model:"


def test_failure_line_of_an_exception_group_is_the_member() -> None:
    def group() -> None:
        raise ExceptionGroup("unhandled errors in a TaskGroup", [FileNotFoundError(2, "No such file")])

    text = formatted(group)
    assert "| FileNotFoundError" in text
    assert failure_line(text) == "FileNotFoundError: [Errno 2] No such file"


def test_failure_line_of_a_plain_message_is_its_first_line() -> None:
    assert failure_line("boom: no model\nsecond line") == "boom: no model"
    assert failure_line("\n\n  only this  \n") == "only this"
    assert failure_line("") == ""
