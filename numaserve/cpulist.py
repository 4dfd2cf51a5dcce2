"""Linux cpulist / nodelist strings ("0-3,8,10-11") and hex masks ("ff,00000001").

Both formats appear throughout sysfs and procfs; every module that reads or
writes them goes through here so there is one parser with one error message.
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["parse_list", "format_list", "parse_mask", "format_mask", "parse_node_spec", "ListSyntaxError"]


class ListSyntaxError(ValueError):
    """A cpulist or mask string that does not parse; the message names the text."""


def parse_list(text: str) -> tuple[int, ...]:
    """Parse a cpulist ("0-3,8,10-11", also "0-7:2" strides) into sorted unique ints.

    An empty or whitespace-only string is the empty list (sysfs writes "\\n" for
    CPU-less nodes).
    """
    out: set[int] = set()
    s = text.strip()
    if not s:
        return ()
    for part in s.split(","):
        part = part.strip()
        if not part:
            raise ListSyntaxError(f"empty element in list {text.strip()!r}")
        stride = 1
        if ":" in part:
            part, _, st = part.partition(":")
            if not st.isdigit() or int(st) < 1:
                raise ListSyntaxError(f"bad stride {st!r} in list {text.strip()!r}")
            stride = int(st)
        lo, sep, hi = part.partition("-")
        if not lo.strip().isdigit() or (sep and not hi.strip().isdigit()):
            raise ListSyntaxError(f"bad element {part!r} in list {text.strip()!r}")
        a = int(lo)
        b = int(hi) if sep else a
        if b < a:
            raise ListSyntaxError(f"descending range {part!r} in list {text.strip()!r}")
        out.update(range(a, b + 1, stride))
    return tuple(sorted(out))


def format_list(items: Iterable[int]) -> str:
    """Format ints as a compact cpulist: {0,1,2,3,8} -> "0-3,8"."""
    vals = sorted(set(int(i) for i in items))
    if not vals:
        return ""
    parts: list[str] = []
    start = prev = vals[0]
    for v in vals[1:]:
        if v == prev + 1:
            prev = v
            continue
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        start = prev = v
    parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(parts)


def parse_mask(text: str) -> tuple[int, ...]:
    """Parse a sysfs hex mask ("ff,00000001": comma-separated 32-bit groups, most
    significant first) into the set bit numbers."""
    s = text.strip().replace(",", "")
    if s.startswith(("0x", "0X")):
        s = s[2:]
    if not s:
        return ()
    try:
        value = int(s, 16)
    except ValueError:
        raise ListSyntaxError(f"bad hex mask {text.strip()!r}") from None
    bits = []
    i = 0
    while value:
        if value & 1:
            bits.append(i)
        value >>= 1
        i += 1
    return tuple(bits)


def format_mask(items: Iterable[int]) -> str:
    """Format ints as a sysfs hex mask with 32-bit comma groups ("1,00000000")."""
    value = 0
    for i in items:
        value |= 1 << int(i)
    groups = []
    while True:
        groups.append(value & 0xFFFFFFFF)
        value >>= 32
        if not value:
            break
    groups.reverse()
    return ",".join([f"{groups[0]:x}"] + [f"{g:08x}" for g in groups[1:]])


def parse_node_spec(spec: str) -> tuple[int, ...] | None:
    """A node selection (``placement.nodes``): None for "all", else the sorted node ids; ValueError
    on bad syntax.  Here, beside the list parser, so the config schema can check it without bind/."""
    s = spec.strip().lower()
    if s in ("all", "*"):
        return None
    if not s:
        raise ValueError("empty node spec")
    try:
        return parse_list(s)
    except ListSyntaxError as e:
        raise ValueError(str(e)) from None
