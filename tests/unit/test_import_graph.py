"""The package's import graph has no circle, and helpers reach the supervisor only through narrow interfaces.

Every import counts: module level, inside functions, and under ``if TYPE_CHECKING:``
(a type-only circle is still a circle in the design).  A failure names the modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "numaserve"

#: Layers: a module in the key's package (or the key module) imports nothing from the listed
#: packages.  The schema sits below everything that reads it; the worker never sees the
#: supervisor; the lower layers see neither.  What two layers share lives at the package top
#: (``numaserve.cmdready``, ``workerenv``, ``unixaddr``, ``memtrim``, ``cpulist``) or in ``control``.
LAYERS: dict[str, tuple[str, ...]] = {
    "config": ("supervisor", "worker", "bind", "net"),
    "worker": ("supervisor",),
    "topology": ("supervisor", "worker"),
    "bind": ("supervisor", "worker"),
    "net": ("supervisor", "worker"),
    "control": ("supervisor", "worker"),
    "loops": ("supervisor", "worker"),
}

#: Modules that act on slots through ``SlotControl`` and must never see the supervisor class.
NARROW = ("operations", "leakwatch", "limits", "ops", "ops_cache", "agerecycle")


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module an imported name lives in (``a.b.C`` -> ``a.b``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path) -> set[str]:
    """Every numaserve module ``name`` imports, wherever the import statement sits."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    deps: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            deps.update(r for a in node.names if (r := _resolve(a.name)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                r = _resolve(full) if full in MODULES else _resolve(base)
                if r:
                    deps.add(r)
    deps.discard(name)
    return deps


def graph() -> dict[str, set[str]]:
    return {name: imports_of(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> str:
    """``numaserve.worker.edge`` -> ``worker``; ``numaserve.config`` -> ``config``."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(g: dict[str, set[str]]) -> list[str]:
    """Every edge of ``g`` that breaks ``LAYERS``, as ``module -> imported``."""
    return sorted(f"{mod} -> {dep}" for mod, deps in g.items() for dep in deps
                  if _layer(dep) in LAYERS.get(_layer(mod), ()))


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``a -> b -> ... -> a``, or None (iterative DFS)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(g, WHITE)
    for start in sorted(g):
        if color[start] != WHITE:
            continue
        stack: list[tuple[str, list[str]]] = [(start, sorted(g[start]))]
        path = [start]
        color[start] = GREY
        while stack:
            node, todo = stack[-1]
            if not todo:
                color[node] = BLACK
                stack.pop()
                path.pop()
                continue
            nxt = todo.pop()
            if color.get(nxt) == GREY:
                return path[path.index(nxt):] + [nxt]
            if color.get(nxt) == WHITE:
                color[nxt] = GREY
                stack.append((nxt, sorted(g[nxt])))
                path.append(nxt)
    return None


def test_cycle_finder_finds_a_planted_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_type_checking_and_function_imports_count(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from numaserve.config import Config\n"
                   "def f():\n    from numaserve.errors import NumaserveError\n")
    assert imports_of("numaserve.m", src) == {"numaserve.config", "numaserve.errors"}


def test_upward_import_finder_names_a_planted_offender() -> None:
    g = {"numaserve.config": {"numaserve.supervisor.cmdready", "numaserve.errors"},
         "numaserve.worker.edge": {"numaserve.control.messages"},
         "numaserve.supervisor.spawn": {"numaserve.worker.main"}}
    assert upward_imports(g) == ["numaserve.config -> numaserve.supervisor.cmdready"]


def test_no_import_points_up_a_layer() -> None:
    bad = upward_imports(graph())
    assert not bad, "imports that point up a layer (move the shared part down): " + ", ".join(bad)


def test_no_import_circle() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("mod", NARROW)
def test_slot_helpers_never_see_the_supervisor(mod: str) -> None:
    """operations/leakwatch/limits/ops/ops_cache act through SlotControl only."""
    name = f"numaserve.supervisor.{mod}"
    path = MODULES[name]
    assert "numaserve.supervisor.arbiter" not in imports_of(name, path)
    tree = ast.parse(path.read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "Supervisor" not in names
    private = sorted({f"{n.value.id}.{n.attr}" for n in ast.walk(tree)
                      if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                      and n.value.id in ("sup", "ctl", "slots_ctl") and n.attr.startswith("_")}
                     | {f"self.sup.{n.attr}" for n in ast.walk(tree)
                        if isinstance(n, ast.Attribute) and n.attr.startswith("_")
                        and isinstance(n.value, ast.Attribute) and n.value.attr in ("sup", "ctl")})
    assert not private, f"{mod} reaches into private state: {private}"


# (no private reach across objects: package-wide in tests/unit/test_private_reaches.py)
