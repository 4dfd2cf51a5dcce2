"""The syntax of a unix bind: ``unix:/PATH``, its file mode and group.

Why apart from ``numaserve.net.unixbind`` (which makes and removes the
socket): the config schema checks these values at load time and must not
import the network layer.  Pure apart from the group lookup.
"""

from __future__ import annotations

import grp
import os

__all__ = ["PREFIX", "MAX_PATH", "is_unix_bind", "unix_path", "parse_mode", "resolve_group"]

PREFIX = "unix:"
MAX_PATH = 107   # sun_path is 108 bytes with its terminating NUL


def is_unix_bind(text: str) -> bool:
    return text.strip().startswith(PREFIX)


def unix_path(text: str) -> str:
    """``unix:/abs/path`` -> the path; ValueError saying what is wrong."""
    path = text.strip()[len(PREFIX):]
    if not path.startswith("/"):
        raise ValueError("expected an absolute path: unix:/run/numaserve.sock")
    if len(os.fsencode(path)) > MAX_PATH:
        raise ValueError(f"path longer than {MAX_PATH} bytes (the kernel's limit for a socket path)")
    if "\0" in path:
        raise ValueError("NUL in path")
    return path


def parse_mode(text: str) -> int:
    """``"0660"`` -> 0o660; ValueError unless 3-4 octal digits."""
    t = text.strip()
    if not 3 <= len(t) <= 4 or any(c not in "01234567" for c in t):
        raise ValueError('expected an octal mode like "0660"')
    return int(t, 8)


def resolve_group(name: str) -> int | None:
    """A group name or number -> gid (None for ""); ValueError for an unknown group."""
    if not name:
        return None
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ValueError(f"no such group {name!r}") from None
