"""Node selection specs: "all" or a list like "0,2-3"."""

from __future__ import annotations

from numaserve.cpulist import ListSyntaxError, parse_list


def parse_node_spec(spec: str) -> tuple[int, ...] | None:
    """Return None for "all", else the sorted node ids; ValueError on bad syntax."""
    s = spec.strip().lower()
    if s in ("all", "*"):
        return None
    if not s:
        raise ValueError("empty node spec")
    try:
        return parse_list(s)
    except ListSyntaxError as e:
        raise ValueError(str(e)) from None
