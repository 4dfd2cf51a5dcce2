"""No object reaches into another object's private members (issue 33 item 3).

``x._name`` is only ever ``self._name`` or ``cls._name``: what one object (or module) needs from
another is a public name, so either side can change without the other's help.  Module-private
functions called by their bare name inside their own module are fine (they are ``Name`` nodes,
not attributes).  The few reaches into the standard library we must make are in ``ALLOWED``
with the reason; uvicorn's internals the worker's overrides use are reached through ``self``
(our subclasses) and are pinned by tests/unit/test_uvicorn_contract.py instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "numaserve"

#: (module path relative to numaserve/, source text of the reach) -> why it must stay.
ALLOWED: dict[tuple[str, str], str] = {
    # a forked template child must leave without running the parent's atexit handlers,
    # flushing its inherited buffers or unwinding (the documented way to end a fork child)
    ("worker/template.py", "os._exit"): "stdlib: end a fork child without the parent's cleanup",
    # asyncio has no public "is this task waiting on a future" (the sentinel counts runnable
    # tasks); both the C and the Python Task expose it under this name since 3.4
    ("worker/shedding.py", "t._fut_waiter"): "stdlib: asyncio.Task has no public waiter query",
    # which module started a thread, for the template's fork-safety message: Thread keeps its
    # target only here (getattr with a default: a Thread subclass may not have one)
    ("worker/template.py", "getattr(t, '_target', None)"): "stdlib: threading.Thread's target",
}


def private_reaches(source: str) -> list[tuple[int, str]]:
    """Every ``x._name`` attribute access in ``source`` where ``x`` is not ``self``/``cls``
    (dunders excluded), as (line, source text)."""
    found = []
    for n in ast.walk(ast.parse(source)):
        if (isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
                and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))):
            found.append((n.lineno, ast.unparse(n)))
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "setattr")
              and len(n.args) >= 2 and isinstance(n.args[1], ast.Constant)
              and isinstance(n.args[1].value, str) and n.args[1].value.startswith("_")
              and not n.args[1].value.startswith("__")
              and not (isinstance(n.args[0], ast.Name) and n.args[0].id in ("self", "cls"))):
            found.append((n.lineno, ast.unparse(n)))
    return sorted(found)


def test_the_finder_names_reaches_and_spares_self_and_module_privates() -> None:
    src = ("import os\n"
           "def _helper(): pass\n"
           "class A:\n"
           "    def f(self, other):\n"
           "        _helper(); self._x = 1; cls = type(self); cls._y\n"
           "        other._x\n"
           "        make()._libc()\n"
           "        getattr(other, '_target', None)\n"
           "        os._exit(0); other.__class__\n")
    assert private_reaches(src) == [
        (6, "other._x"), (7, "make()._libc"), (8, "getattr(other, '_target', None)"), (9, "os._exit"),
    ]


def test_no_private_reach_across_objects() -> None:
    found, used = [], set()
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        for line, text in private_reaches(path.read_text()):
            if (rel, text) in ALLOWED:
                used.add((rel, text))
            else:
                found.append(f"numaserve/{rel}:{line} {text}")
    assert not found, "reaches into another object's private members (use or add a public name): " + \
        ", ".join(found)
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"allow-list entries that no longer occur (remove them): {stale}"
