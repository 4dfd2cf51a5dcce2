"""What ``numaserve config check FILE`` finds: every error ``start`` would refuse, with file:line.

The loader stops at the first error, so the check drops the key an error
names and checks again until the rest passes; then it runs what ``start``
checks before it binds anything (bind addresses, including that this machine
has them, the cmd template, TLS files, the allocator, the topology and
plan).  tomllib gives no positions, so each error's line is found by a small
scan of the file for the key under its table header.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from numaserve.config import ENV_PREFIX, SECTIONS, Config, read_config_file, validate_data
from numaserve.errors import ConfigError, NumaserveError

_HEADER = re.compile(r"^\[\s*([A-Za-z0-9_.\"'-]+)\s*\]")
_KEY = re.compile(r"^([A-Za-z0-9_.\"'-]+)\s*=")
_NAMED = re.compile(r"unknown section \[(\w+)\]|\b(\w+)\.(\w+)\b")


@dataclass(frozen=True)
class Problem:
    """One error: where (``file:line``, an environment variable, or the file) and what."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


def key_line(text: str, section: str, key: str = "") -> int | None:
    """1-based line of ``key`` in table ``[section]`` (or of the header when ``key`` is "" or not found)."""
    current: str | None = None
    header: int | None = None
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("[["):
            current = None
            continue
        m = _HEADER.match(s)
        if m:
            current = m.group(1).strip("\"'")
            if current == section and header is None:
                header = n
            continue
        k = _KEY.match(s)
        if k and key:
            name = ".".join(p.strip().strip("\"'") for p in k.group(1).split("."))
            if (current == section and name == key) or (current is None and name == f"{section}.{key}"):
                return n
        if k and current is None and not key and k.group(1).strip("\"'") == section:
            return n  # section = { ... } inline
    return header


def _named(message: str) -> tuple[str, str] | None:
    """The (section, key) an error message names first; key "" for a whole section."""
    for m in _NAMED.finditer(message):
        if m.group(1):
            return m.group(1), ""
        if m.group(2) in SECTIONS:
            return m.group(2), m.group(3)
    return None


class _Check:
    def __init__(self, path: Path, environ: Mapping[str, str]) -> None:
        self.path = path
        self.text = path.read_text(encoding="utf-8", errors="replace")
        self.environ = dict(environ)
        self.problems: list[Problem] = []

    def record(self, message: str) -> tuple[str, str] | None:
        """Add ``message`` with its file:line; returns the (section, key) it names."""
        prefix = f"{self.path}: "
        named = _named(message)
        var = f"{ENV_PREFIX}{named[0]}_{named[1]}".upper() if named and named[1] else ""
        if var in self.environ and not message.startswith("environment "):
            self.problems.append(Problem(f"environment {var}", message.removeprefix(prefix)))
        elif message.startswith(prefix) or not message.startswith(("environment ", "default: ", "config: ")):
            rest = message[len(prefix):] if message.startswith(prefix) else message
            line = key_line(self.text, *named) if named else None
            where = f"{self.path}:{line}" if line else str(self.path)
            self.problems.append(Problem(where, rest))
        else:
            where, _, rest = message.partition(": ")
            self.problems.append(Problem(where, rest))
        return named

    def drop(self, data: dict[str, Any], named: tuple[str, str] | None) -> bool:
        """Remove what an error named from the file data or the environment; False if nothing was there."""
        if named is None:
            return False
        section, key = named
        var = f"{ENV_PREFIX}{section}_{key}".upper()
        if key and var in self.environ:
            del self.environ[var]
            return True
        if not key:
            return data.pop(section, None) is not None
        body = data.get(section)
        if isinstance(body, dict) and key in body:
            del body[key]
            return True
        return False

    def config(self, data: dict[str, Any]) -> Config | None:
        """The config once every bad key is dropped (None when an error cannot be isolated)."""
        seen: set[str] = set()
        for _ in range(1 + sum(len(v) if isinstance(v, dict) else 1 for v in data.values()) + len(self.environ)):
            try:
                return validate_data(data, str(self.path), self.environ)
            except ConfigError as e:
                msg = str(e)
                if msg in seen:
                    return None
                seen.add(msg)
                named = _named(msg)
                if not self.drop(data, named):
                    if not self.problems:  # the first error stands on its own; later ones follow from a drop
                        self.record(msg)
                    return None
                self.record(msg)
        return None

    def start_checks(self, cfg: Config) -> None:
        """What ``start`` refuses before it binds: bind addresses (and that they are ours), then prepare()."""
        import socket

        from numaserve.net.listeners import resolve_bind
        from numaserve.net.portowners import check_address_is_local

        for text in cfg.server.bind:
            try:
                b = resolve_bind(text)
                if b.family in (socket.AF_INET, socket.AF_INET6):  # a unix: path is checked when start binds it
                    check_address_is_local(b)
            except NumaserveError as e:
                self.record(str(e))
        try:
            from numaserve.net.listeners import resolve_binds

            resolve_binds(cfg.server.bind)  # the same address twice
        except NumaserveError as e:
            if "same address" in str(e):
                self.record(str(e))
        from numaserve.supervisor.prepare import prepare

        try:
            prepare(cfg)
        except NumaserveError as e:
            self.record(str(e))


def check_file(path: str, environ: Mapping[str, str]) -> list[Problem]:
    """Every problem ``start`` would have with config ``path`` under ``environ`` (empty: it would start)."""
    p = Path(path)
    try:
        data = read_config_file(p)
    except ConfigError as e:
        return [Problem(str(p), str(e).removeprefix(f"{p}: "))]
    check = _Check(p, environ)
    cfg = check.config(data)
    if cfg is not None:  # bad keys dropped: what start checks next still gets checked
        check.start_checks(cfg)
    return sorted(check.problems, key=_file_order)


def _file_order(p: Problem) -> tuple[int, int]:
    """Environment and file-wide problems first, then by line in the file."""
    line = p.where.rpartition(":")[2]
    return (1, int(line)) if line.isdigit() else (0, 0)
