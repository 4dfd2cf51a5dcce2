"""Read-only access to a sysfs/procfs tree rooted at a path.

Discovery never opens a host path directly: every read goes through a
``Root`` so the same logic runs on this machine ("/") and on dumps
(hwloc-gather-topology tarballs, hand-made test trees).  On a dump, symlinks
are resolved *inside* the root, as a chroot would (absolute targets restart
at the root, ".." stops at it), never against the host's "/".

Reads never raise: a missing or unreadable file is ``None``, an empty file is
``""``.  Callers decide what is unknown and record why (``Unknowns``).
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field

from numaserve.cpulist import ListSyntaxError, parse_list, parse_mask
from numaserve.topology.model import Unknown

__all__ = ["Root", "Unknowns", "read_cpus", "read_int"]

_MAX_LINK_HOPS = 40


class Root:
    """A sysfs/procfs tree at ``base``; paths are given relative to it ("sys/...")."""

    def __init__(self, base: str = "/") -> None:
        self.base = os.path.abspath(base)
        self.is_host = os.path.realpath(self.base) == "/"
        self._cache: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"Root({self.base!r})"

    # --- paths -------------------------------------------------------------

    def resolve(self, rel: str) -> str:
        """In-root absolute path ("/sys/devices/...") with every symlink resolved inside the root."""
        rel = rel.strip("/")
        hit = self._cache.get(rel)
        if hit is not None:
            return hit
        parts = deque(p for p in rel.split("/") if p not in ("", "."))
        done: list[str] = []
        hops = 0
        while parts:
            p = parts.popleft()
            if p == "..":
                if done:
                    done.pop()
                continue
            try:
                target = os.readlink(os.path.join(self.base, *done, p))
            except OSError:  # not a link, or missing: keep the name as is
                done.append(p)
                continue
            hops += 1
            if hops > _MAX_LINK_HOPS:  # a loop: stop resolving, keep the name
                done.append(p)
                continue
            if target.startswith("/"):
                done = []
            parts.extendleft(reversed([x for x in target.split("/") if x not in ("", ".")]))
        out = "/" + "/".join(done)
        self._cache[rel] = out
        return out

    def host_path(self, rel: str) -> str:
        """The host path to open for ``rel`` (symlinks already resolved inside the root)."""
        if self.is_host:
            return os.path.join("/", rel.lstrip("/"))
        return os.path.join(self.base, self.resolve(rel).lstrip("/"))

    # --- reads -------------------------------------------------------------

    def read(self, rel: str) -> str | None:
        """File text (undecodable bytes replaced), ``None`` when missing or unreadable."""
        try:
            with open(self.host_path(rel), "rb") as f:
                data = f.read(1 << 20)
        except (OSError, ValueError):
            return None
        return data.decode("utf-8", errors="replace")

    def listdir(self, rel: str) -> list[str]:
        """Entry names of a directory, sorted; ``[]`` when missing or not a directory."""
        try:
            return sorted(os.listdir(self.host_path(rel)))
        except (OSError, ValueError):
            return []

    def is_dir(self, rel: str) -> bool:
        return os.path.isdir(self.host_path(rel))

    def exists(self, rel: str) -> bool:
        return os.path.exists(self.host_path(rel))

    def readlink(self, rel: str) -> str | None:
        """The link text of ``rel`` (not resolved), ``None`` when it is not a link."""
        parent, _, name = rel.rstrip("/").rpartition("/")
        base = self.host_path(parent) if parent else self.base
        try:
            return os.readlink(os.path.join(base, name))
        except OSError:
            return None


@dataclass
class Unknowns:
    """Collects what discovery could not read, in order, without duplicates."""

    items: list[Unknown] = field(default_factory=list)

    def add(self, what: str, reason: str) -> None:
        u = Unknown(what, reason)
        if u not in self.items:
            self.items.append(u)


def read_int(fs: Root, rel: str) -> int | None:
    """An integer file (decimal or 0x hex), ``None`` when missing, empty or garbage."""
    text = fs.read(rel)
    if text is None:
        return None
    s = text.strip()
    try:
        return int(s, 16) if s.lower().startswith("0x") else int(s)
    except ValueError:
        return None


def read_list(fs: Root, rel: str) -> tuple[int, ...] | None:
    """A cpulist-format file (``0-3,8``) as a tuple; None when missing or malformed."""
    text = fs.read(rel)
    if text is None:
        return None
    try:
        return parse_list(text)
    except ListSyntaxError:
        return None


def read_cpus(
    fs: Root, list_rel: str | None, mask_rel: str | None, what: str, unknowns: Unknowns | None
) -> tuple[int, ...] | None:
    """A CPU (or node) set from a cpulist file, else a hex mask file.

    ``None`` when neither is readable or parses; an ``Unknown`` naming ``what``
    is recorded when ``unknowns`` is given.
    """
    problems: list[str] = []
    for rel, parse in ((list_rel, parse_list), (mask_rel, parse_mask)):
        if rel is None:
            continue
        text = fs.read(rel)
        if text is None:
            problems.append(f"{rel}: missing")
            continue
        try:
            return parse(text)
        except ListSyntaxError as e:
            problems.append(f"{rel}: {e}")
    if unknowns is not None:
        unknowns.add(what, "; ".join(problems) or "no file to read")
    return None
