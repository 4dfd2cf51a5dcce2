"""Import the served ASGI app from ``"module:attr"`` / ``"module:factory()"``.

Failures become one ``AppLoadError`` with a one-line reason, because the
reason travels in ``Goodbye`` and ends up in ``numaserve status``: a
traceback belongs in the log, not in a status column.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from typing import Any

__all__ = ["DEFAULT_APP", "AppLoadError", "describe_exception", "failure_line", "load_app", "remember_app"]

DEFAULT_APP = "numaserve.apps.demo:app"


#: Apps a warm template already loaded, by (ref, app_dir): a worker forked from it
#: serves that object (a ``module:factory()`` is not called a second time).
_loaded: dict[tuple[str, str], Any] = {}


def remember_app(ref: str, app_dir: str, app: Any) -> None:
    """Record the app a template loaded so ``load_app`` in its forked workers returns it."""
    _loaded[(ref.strip() or DEFAULT_APP, app_dir)] = app


class AppLoadError(Exception):
    """The app could not be imported, found or built; ``str()`` is one line."""


def describe_exception(exc: BaseException) -> str:
    """``"Type: first line of message"`` — short enough for a status line."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    name = type(exc).__name__
    return f"{name}: {first}" if first else name


#: Lines of a formatted traceback that are structure, not the exception.
_TRACEBACK_HEADERS = ("Traceback (most recent call last):", "Exception Group Traceback",
                      "During handling of the above exception", "The above exception was the direct cause")
#: The box drawn around an exception group's members ("  | ", "    | ").
_GROUP_PREFIX = re.compile(r"^\s*(?:\| ?)")


def failure_line(text: str) -> str:
    """The one line worth reporting from a failure message.

    Frameworks report a failed lifespan startup with the whole traceback as
    the message (Starlette: ``traceback.format_exc()``), whose first line is
    "Traceback (most recent call last):" and whose *last* exception line
    ("FileNotFoundError: [Errno 2] ...") is what an operator needs.  Works
    for chained exceptions (the last raised wins) and exception groups (the
    innermost member).  Any other message: its first non-empty line.
    """
    lines = [line.rstrip() for line in text.strip().splitlines()]
    if not any(h in text for h in _TRACEBACK_HEADERS[:2]):
        return next((line.strip() for line in lines if line.strip()), "")
    found = ""
    for line in lines:
        body = _GROUP_PREFIX.sub("", line, count=1) if line.lstrip().startswith("|") else line
        if not body or body[0].isspace() or body[0] in "+-" or body.startswith(_TRACEBACK_HEADERS):
            continue  # frames, source lines, group boxes, section headers
        found = body
    return found or next((line.strip() for line in lines if line.strip()), "")


def _is_asgi3(app: Any) -> bool:
    """uvicorn's test (an async callable, or a class with ``__await__``), plus bound methods."""
    if inspect.isclass(app):
        return hasattr(app, "__await__")
    if inspect.iscoroutinefunction(app):
        return True
    if inspect.isfunction(app) or inspect.ismethod(app):
        return False
    return inspect.iscoroutinefunction(getattr(app, "__call__", None))


def import_attr(module_name: str, attr_path: str, error: type[Exception], what: str = "") -> Any:
    """``module_name`` imported and ``attr_path`` (dotted) looked up in it; any failure is
    ``error`` with one line naming the exception (the app's or a hook's import may raise
    anything, even SystemExit; only KeyboardInterrupt passes)."""
    try:
        obj: Any = importlib.import_module(module_name)
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, KeyboardInterrupt):
            raise
        raise error(f"{describe_exception(e)} (importing {what}{module_name!r})") from e
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise error(f"AttributeError: module {module_name!r} has no attribute {attr_path!r}") from None
    return obj


def load_app(ref: str, app_dir: str = "") -> Any:
    """Return the ASGI 3 callable named by ``ref`` ("" means the demo app).

    ``app_dir`` is put first on ``sys.path`` so the operator's code wins over
    anything installed.  ``"mod:make()"`` calls the factory with no arguments.
    ASGI 2 apps are adapted with uvicorn's own wrapper so our ASGI 3 middleware
    can sit in front of them.
    """
    ref = ref.strip() or DEFAULT_APP
    if (ref, app_dir) in _loaded:
        return _loaded[(ref, app_dir)]
    if app_dir and app_dir not in sys.path:
        sys.path.insert(0, app_dir)
    module_name, sep, attr_path = ref.partition(":")
    call = attr_path.endswith("()")
    if call:
        attr_path = attr_path[:-2]
    if not sep or not module_name or not attr_path:
        raise AppLoadError(
            f"ValueError: bad app reference {ref!r}: expected 'module:attr' or 'module:factory()'")
    obj = import_attr(module_name, attr_path, AppLoadError)
    if call:
        try:
            obj = obj()
        except BaseException as e:  # noqa: BLE001
            if isinstance(e, KeyboardInterrupt):
                raise
            raise AppLoadError(f"{describe_exception(e)} (calling factory {ref!r})") from e
    if not callable(obj):
        raise AppLoadError(f"TypeError: {ref!r} is a {type(obj).__name__}, not an ASGI callable")
    if not _is_asgi3(obj):
        from uvicorn.middleware.asgi2 import ASGI2Middleware

        obj = ASGI2Middleware(obj)
    return obj
