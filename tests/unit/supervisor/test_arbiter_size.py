"""The composition root stays a composition root: ``Supervisor`` wires roles and runs the loop.

Issue 33 measured 71 methods + 6 property forwarders and 56 attributes, most of them
forwarders so that one object satisfied every helper's protocol.  The roles now take the
slot table, the worker channel and the routing directly; this keeps it that way.
"""

from __future__ import annotations

import ast
from pathlib import Path

ARBITER = Path(__file__).resolve().parents[3] / "numaserve" / "supervisor" / "arbiter.py"
MAX_METHODS = 30
MAX_ATTRIBUTES = 25


def supervisor_size(path: Path = ARBITER) -> tuple[list[str], set[str]]:
    """(methods incl. properties and ``x = property(...)``, distinct ``self.X`` stores) of class Supervisor."""
    cls = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == "Supervisor")
    methods = [n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    methods += [t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name) and isinstance(n.value, ast.Call)
                and isinstance(n.value.func, ast.Name) and n.value.func.id == "property"]
    attrs: set[str] = set()
    for n in ast.walk(cls):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for x in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) and x.value.id == "self":
                    attrs.add(x.attr)
    return methods, attrs


def test_the_supervisor_stays_small() -> None:
    methods, attrs = supervisor_size()
    assert len(methods) <= MAX_METHODS, f"{len(methods)} methods (at most {MAX_METHODS}): {methods}"
    assert len(attrs) <= MAX_ATTRIBUTES, f"{len(attrs)} attributes (at most {MAX_ATTRIBUTES}): {sorted(attrs)}"


def test_the_count_sees_forwarders(tmp_path: Path) -> None:
    src = tmp_path / "arbiter.py"
    src.write_text("class Supervisor:\n"
                   "    def __init__(self):\n        self.a = 1\n        self.b, self.c = 2, 3\n"
                   "    stopping = property(lambda self: self.a)\n"
                   "    async def run(self):\n        self.a += 1\n")
    methods, attrs = supervisor_size(src)
    assert methods == ["__init__", "run", "stopping"] and attrs == {"a", "b", "c"}
