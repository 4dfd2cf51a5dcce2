"""One owner of slot transitions: only the slot table (``slottable``) and the supervision state
machine it extends (``lifecycle``) store to a slot's or a worker's lifecycle fields.

An AST scan of numaserve/: every store (``x.f = ...``, ``x.f += ...``, ``del x.f``) to a
lifecycle field, and every mutating call on a slot's ``retiring`` list or ``restart``
history, outside ``self``.  Field names come from the dataclasses, so a new slot field is
covered the day it is added.  What a worker *says* (hello, beats, stats, probe notes) is
message data, written where messages are read, and is not scanned.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from numaserve.supervisor.slots import SlotState

ROOT = Path(__file__).resolve().parents[3] / "numaserve"

#: The two modules allowed to write slot state.
WRITERS = {"supervisor/lifecycle.py", "supervisor/slottable.py"}

#: Slot fields that are not lifecycle state: the plan, and counters summed over generations.
SLOT_DATA = {"plan", "requests_before", "totals_before"}
SLOT_FIELDS = {f.name for f in dataclasses.fields(SlotState)} - SLOT_DATA
WORKER_FIELDS = {"ready", "stop_sent", "stop_deadline", "abort_sent", "kill_sent", "kill_reason",
                 "exit_code", "exit_cause"}
MUTATED_BY_CALLS = {"retiring", "restart"}   # a slot's list of draining workers, its crash history

#: Other classes with fields of the same names, by (module, receiver): not slots.
NOT_SLOTS = {
    ("supervisor/operations.py", "op"): "Operation.state",
    ("supervisor/templates.py", "t"): "TemplateProc.state / exit_code",
    ("supervisor/templates.py", "z"): "TemplateProc.state (the zygote)",
    ("supervisor/templates.py", "nt"): "NodeTemplate.generation / next_start / restarts / last_exit",
}


def _receiver(node: ast.expr) -> str:
    return ast.unparse(node)


def _stores(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, receiver, field) of every store to an attribute not on ``self``/``cls``."""
    out = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        flat: list[ast.expr] = []
        for t in targets:
            flat.extend(t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t])
        for t in flat:
            if isinstance(t, ast.Attribute) and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls")):
                out.append((node.lineno, _receiver(t.value), t.attr))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr in MUTATED_BY_CALLS:
            out.append((node.lineno, _receiver(node.func.value.value), node.func.value.attr))
    return out


def slot_writes(root: Path = ROOT) -> dict[str, list[str]]:
    """module (relative to numaserve/) -> the slot/worker lifecycle writes found in it."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for line, recv, field in _stores(ast.parse(path.read_text())):
            if field not in SLOT_FIELDS | WORKER_FIELDS | MUTATED_BY_CALLS:
                continue
            if (rel, recv.split(".")[0]) in NOT_SLOTS:
                continue
            found.setdefault(rel, []).append(f"{rel}:{line} {recv}.{field}")
    return found


def test_only_the_slot_table_writes_slot_state() -> None:
    found = slot_writes()
    outside = {mod: writes for mod, writes in found.items() if mod not in WRITERS}
    assert not outside, (
        "slot or worker lifecycle state written outside the slot table (use a SlotTable verb): "
        + "; ".join(w for writes in outside.values() for w in writes))
    assert set(found) == WRITERS, f"expected the writers {sorted(WRITERS)}, found {sorted(found)}"


def test_the_scan_sees_a_write_from_elsewhere(tmp_path: Path) -> None:
    """The scan is not vacuous: a store, an augmented store and a list mutation are each caught."""
    mod = tmp_path / "supervisor" / "rogue.py"
    mod.parent.mkdir()
    mod.write_text("def f(slot, w, op):\n"
                   "    slot.state = 'ready'\n"
                   "    w.kill_reason, slot.incoming = 'x', None\n"
                   "    slot.restarts += 1\n"
                   "    slot.retiring.append(w)\n"
                   "    slot.restart.reset()\n"
                   "    w.last_beat = 1.0\n"       # message data: not lifecycle state
                   "    op.state = 'failed'\n")    # not a slot (in this module, op is not excused)
    writes = slot_writes(tmp_path)["supervisor/rogue.py"]
    assert sorted(w.split(" ", 1)[1] for w in writes) == sorted([
        "slot.state", "w.kill_reason", "slot.incoming", "slot.restarts", "slot.retiring", "slot.restart", "op.state"])
