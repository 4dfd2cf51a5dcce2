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


def test_the_cycles_request_accounting_names_are_not_uvicorns() -> None:
    """LeanCycle is also a ``RequestAcct`` (numaserve/worker/requestacct.py): its slots and methods
    share the cycle's namespace, so uvicorn's RequestResponseCycle must not use any of those names."""
    from numaserve.worker.requestacct import RequestAcct

    ours = set(RequestAcct.__slots__) | {n for n, f in vars(RequestAcct).items() if inspect.isfunction(f)}
    used: set[str] = set(dir(RequestResponseCycle))
    for fn in vars(RequestResponseCycle).values():
        if inspect.isfunction(fn):
            tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
            used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                     and isinstance(n.value, ast.Name) and n.value.id == "self"}
    clash = sorted(ours & used)
    assert not clash, (f"uvicorn's RequestResponseCycle now uses {clash}, names numaserve's RequestAcct gives "
                       f"LeanCycle; rename them in numaserve/worker/requestacct.py")


# --- frames on the HTTP port (numaserve/worker/sniff.py) -----------------------------------------
# ``first_read`` runs inside uvicorn's HTTP protocols (ours on httptools, ``sniffing_h11`` on h11) and,
# for a frame connection, reads what they set to make the FrameProtocol that stands beside them
# (uvicorn calls ``shutdown()`` on it when draining, as on its own protocols).

#: What ``first_read`` reads from the HTTP protocol it runs in.
FIRST_READ_USES = {"config", "server_state", "app_state", "loop", "server", "client", "scheme", "transport"}


def _self_assignments(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in cls.__mro__:
        for fn in _own_methods(klass).values():
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
            except (OSError, TypeError):
                continue
            for n in ast.walk(tree):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
                for t in targets:
                    for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                            names.add(e.attr)
    return names


@pytest.mark.parametrize("impl", ["httptools", "h11"])
def test_uvicorns_http_protocols_still_set_what_first_read_hands_to_frames(impl: str) -> None:
    from numaserve.worker import sniff

    src = inspect.getsource(sniff.first_read)
    used = {n.attr for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "proto"}
    assert used - {"blank_bytes", "sniffing", "frames_took_over"} == FIRST_READ_USES, "update FIRST_READ_USES"
    if impl == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol as cls
    else:
        cls = HttpToolsProtocol
    missing = sorted(FIRST_READ_USES - _self_assignments(cls))
    assert not missing, (f"uvicorn's {cls.__name__} no longer sets {missing}, which numaserve's first_read "
                         f"hands to a FrameProtocol; re-check numaserve/worker/sniff.py")
    for hook in ("shutdown", "connection_lost", "eof_received", "pause_writing", "resume_writing"):
        assert _params(getattr(cls, hook)) == _params(getattr(sniff.FrameProtocol, hook)), (
            f"uvicorn's {cls.__name__}.{hook} changed its parameters to {_params(getattr(cls, hook))}: "
            f"numaserve's FrameProtocol.{hook} stands beside it; re-check numaserve/worker/sniff.py")


def test_the_uvicorn_config_and_server_state_the_frame_protocol_reads_are_still_there() -> None:
    import uvicorn.server

    from numaserve.worker.sniff import FrameProtocol

    config = Config(app=lambda scope, receive, send: None, http="httptools", log_config=None)
    config.load()
    reads: dict[str, set[str]] = {"config": set(), "server_state": set()}
    for fn in _own_methods(FrameProtocol).values():
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
                    and isinstance(n.value.value, ast.Name) and n.value.value.id == "self"
                    and n.value.attr in reads):
                reads[n.value.attr].add(n.attr)
    assert reads["config"] and reads["server_state"], "the AST walk found no reads: update this test"
    state = ServerState()
    gone = sorted(f"config.{a}" for a in reads["config"] if not hasattr(config, a))
    gone += sorted(f"server_state.{a}" for a in reads["server_state"] if not hasattr(state, a))
    assert not gone, (f"numaserve's FrameProtocol reads {gone}, which this uvicorn no longer has; "
                      f"re-check numaserve/worker/sniff.py")
    # uvicorn's Server drains through ``connection.shutdown()`` on every registered connection
    assert "connection.shutdown()" in inspect.getsource(uvicorn.server.Server.shutdown), (
        "uvicorn's Server.shutdown no longer calls connection.shutdown(): FrameProtocol.shutdown and "
        "the worker's drain (numaserve/worker/serve.py) rely on it")
