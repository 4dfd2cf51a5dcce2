"""The uvicorn internals the worker's HTTP protocol is built on, checked against the installed uvicorn.

numaserve/worker/httpproto.py subclasses uvicorn's ``HttpToolsProtocol`` and
``RequestResponseCycle`` and overrides some of their methods (setup.cfg bounds
uvicorn to the minor versions this was checked against).  A uvicorn upgrade
that renames an overridden method, changes its parameters, or stops setting
an attribute the subclass reads would break serving quietly (the override is
never called, or an AttributeError per request); these tests fail first, with
a message naming what moved.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import textwrap
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from numaserve.worker import httpproto


def _pairs() -> list[tuple[type, type]]:
    return [(httpproto.GuardedHttpToolsProtocol, HttpToolsProtocol), (httpproto.LeanCycle, RequestResponseCycle)]


def _own_methods(cls: type) -> dict[str, Any]:
    return {n: f for n, f in vars(cls).items() if inspect.isfunction(f)}


def _params(fn: Any) -> list[str]:
    """Parameter names and kinds, without annotations or defaults (those may differ harmlessly)."""
    return [f"{p.kind.name}:{p.name}" for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("ours,base", _pairs(), ids=["protocol", "cycle"])
def test_every_overridden_method_still_exists_in_uvicorn_with_the_same_parameters(ours: type, base: type) -> None:
    for name, fn in _own_methods(ours).items():
        theirs = getattr(base, name, None)
        if theirs is None or not callable(theirs):
            continue  # numaserve's own helper
        if name == "__init__":
            continue  # the protocol's passes *args/**kwargs through; the cycle is made by numaserve itself
        got = _params(fn)
        assert got == _params(theirs), (
            f"uvicorn's {base.__name__}.{name} changed its parameters: {_params(theirs)} "
            f"(numaserve's override has {got}); re-check numaserve/worker/httpproto.py against this uvicorn")


# Methods numaserve overrides on purpose.  A name here that uvicorn no longer has means the
# override is dead code and uvicorn's new behaviour runs instead (the case the test exists for).
INTENDED = {
    "protocol": {"__init__", "connection_made", "connection_lost", "data_received", "send_400_response",
                 "on_message_begin", "on_header", "on_headers_complete", "on_body", "on_message_complete",
                 "on_response_complete"},
    "cycle": {"__init__", "run_asgi", "send", "receive"},
}


@pytest.mark.parametrize("which", ["protocol", "cycle"])
def test_the_methods_numaserve_means_to_override_are_still_uvicorns(which: str) -> None:
    ours, base = dict(zip(["protocol", "cycle"], _pairs()))[which]
    missing = sorted(n for n in INTENDED[which] if not callable(getattr(base, n, None)))
    assert not missing, (f"uvicorn's {base.__name__} no longer has {missing}: numaserve's overrides of them "
                         f"are never called; re-check numaserve/worker/httpproto.py against this uvicorn")
    overridden = {n for n in _own_methods(ours) if callable(getattr(base, n, None))}
    stale = sorted(INTENDED[which] - overridden)
    assert not stale, f"numaserve's {ours.__name__} no longer overrides {stale}: update INTENDED"


def _self_attributes(cls: type, ctx: type[ast.expr_context]) -> set[str]:
    """``self.NAME`` loads (``ast.Load``) or stores (``ast.Store``) in the class's own methods."""
    names: set[str] = set()
    for fn in _own_methods(cls).values():
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        except (OSError, TypeError):
            continue
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                  and n.value.id == "self" and isinstance(n.ctx, ctx)}
    return names


def _attributes_read(cls: type) -> set[str]:
    return _self_attributes(cls, ast.Load)


def _attributes_set(cls: type) -> set[str]:
    return _self_attributes(cls, ast.Store)


def test_every_uvicorn_attribute_the_protocol_reads_is_set_by_uvicorn() -> None:
    proto_cls, _ = _pairs()[0]
    config = Config(app=lambda scope, receive, send: None, http="httptools", log_config=None)
    config.load()
    loop = asyncio.new_event_loop()   # (uvicorn asks for the current loop when given none)
    try:
        uv = HttpToolsProtocol(config=config, server_state=ServerState(), app_state={}, _loop=loop)
    finally:
        loop.close()
    mine = _attributes_set(proto_cls) | set(dir(proto_cls))
    theirs = set(vars(uv)) | set(dir(HttpToolsProtocol))
    gone = sorted(a for a in _attributes_read(proto_cls) - mine if a not in theirs)
    assert not gone, (f"numaserve's protocol reads {gone} that uvicorn's HttpToolsProtocol no longer sets; "
                      f"re-check numaserve/worker/httpproto.py against this uvicorn")


def test_the_cycle_sets_every_attribute_uvicorns_own_cycle_methods_read() -> None:
    """LeanCycle does not call uvicorn's ``__init__``: what uvicorn's methods that it keeps (``send``,
    ``receive``, ``send_500_response``) read must be set by LeanCycle's own ``__init__``."""
    _, (cycle_cls, base) = _pairs()
    kept = [n for n, f in vars(base).items() if inspect.isfunction(f) and n not in vars(cycle_cls)]
    read: set[str] = set()
    for name in kept:
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(base, name))))
        read |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                 and n.value.id == "self" and isinstance(n.ctx, ast.Load)}
    mine = _attributes_set(cycle_cls) | set(dir(cycle_cls))
    unset = sorted(read - mine)
    assert kept, "uvicorn's RequestResponseCycle has no methods numaserve keeps"
    assert not unset, (f"uvicorn's RequestResponseCycle methods {kept} read {unset}, which numaserve's "
                       f"LeanCycle.__init__ does not set; re-check numaserve/worker/httpproto.py against this uvicorn")
