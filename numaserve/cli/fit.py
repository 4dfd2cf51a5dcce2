"""Tables that fit the terminal: columns by priority, the rest wrapped under each row (pure).

An operator's terminal is often 80 columns (a laptop split, tmux, a serial
console).  Instead of cutting every cell ("sl…", "15…") like a fixed-width
table, :func:`fit_table` keeps as many whole columns as fit, most important
first (shown in their natural order), and prints the others as
``name value`` pairs on indented lines under their row, wrapped at the width.
With room for everything it is a plain one-line-per-row table.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["Column", "fit_table", "terminal_width", "wrap_parts"]

_GAP = "  "
_INDENT = "    "


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    priority: int           # lower is kept longer; ties keep the natural order
    right: bool = False     # right-aligned (numbers)
    short: str = ""         # the title when not every column fits ("" = the title)
    quiet: tuple[str, ...] = ("", "-")  # values left out of detail lines (the normal case)


def terminal_width(default_off_tty: int = 200) -> int:
    """``$COLUMNS`` if set, else the terminal's width, else a wide line for pipes and logs."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    if sys.stdout.isatty():
        return shutil.get_terminal_size((80, 24)).columns
    return default_off_tty


def _cell(value: str, width: int, right: bool) -> str:
    return value.rjust(width) if right else value.ljust(width)


def _choose(columns: Sequence[Column], widths: Mapping[str, int], width: int) -> list[Column]:
    kept: list[Column] = []
    used = 0
    for col in sorted(columns, key=lambda c: c.priority):
        need = widths[col.key] + (len(_GAP) if kept else 0)
        if used + need <= width:
            kept.append(col)
            used += need
    return [c for c in columns if c in kept]


def wrap_parts(parts: Sequence[str], width: int, indent: str = "") -> list[str]:
    """``parts`` joined by two spaces, broken between parts so lines fit ``width``."""
    lines: list[str] = []
    line = ""
    for part in parts:
        candidate = part if not line else line + _GAP + part
        if line and len(indent) + len(candidate) > width:
            lines.append(indent + line)
            candidate = part
        line = candidate
    if line:
        lines.append(indent + line)
    return lines


def fit_table(columns: Sequence[Column], rows: Sequence[Mapping[str, str]], width: int,
              details: bool = True) -> list[str]:
    """Header + one line per row (+ wrapped detail lines for the columns that did not fit).

    ``rows`` map column keys to their text.  When not every column fits, the
    short titles are used and the columns that still do not fit go to the
    detail lines, where a column's ``quiet`` values (the normal case: empty,
    "-") are left out, so a healthy row stays short.  Long detail values wrap
    at word boundaries; nothing is cut.  ``details=False`` (a live view that
    must keep one line per row) drops those columns instead.
    """
    def widths_for(short: bool) -> dict[str, int]:
        return {c.key: max([len(_title(c, short)), *(len(r.get(c.key, "")) for r in rows)]) for c in columns}

    widths = widths_for(False)
    kept = _choose(columns, widths, width)
    short = len(kept) < len(columns)
    if short:
        widths = widths_for(True)
        kept = _choose(columns, widths, width)
    rest = [c for c in columns if c not in kept]
    out = [_GAP.join(_cell(_title(c, short), widths[c.key], c.right) for c in kept).rstrip()]
    for row in rows:
        out.append(_GAP.join(_cell(row.get(c.key, ""), widths[c.key], c.right) for c in kept).rstrip())
        if not details:
            continue
        pairs = [f"{c.title} {row.get(c.key, '')}" for c in rest if row.get(c.key, "") not in c.quiet]
        fitting = [p for p in pairs if len(_INDENT) + len(p) <= width]
        out.extend(wrap_parts(fitting, width, _INDENT))
        for p in pairs:
            if p not in fitting:  # one long value (a failure reason): its own wrapped lines
                out.extend(textwrap.wrap(p, width, initial_indent=_INDENT, subsequent_indent=_INDENT + "  ",
                                         break_on_hyphens=False))
    return out


def _title(col: Column, short: bool) -> str:
    return (col.short or col.title) if short else col.title
