"""The authorized CURVE client keys of remote ops, re-read on reload and SIGHUP.

pyzmq's ``Authenticator.configure_curve`` keeps the *old* keys when the
directory cannot be read (it logs and returns), and only reads it when
called; here the key set is ours: loaded at start, re-loaded on every
``reload``/SIGHUP, and empty (every client refused) when the directory is
gone -- a revocation must never fail open.  The ZAP handler asks
``callback`` for each new connection (``configure_curve_callback``); a
connection already authenticated is not asked again, which is why the ops
loop also checks each request's key (``User-Id``) against the current set.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

import structlog

__all__ = ["AuthorizedKeys", "KeyChange"]

log = structlog.get_logger("numaserve.ops")


@dataclass(frozen=True)
class KeyChange:
    added: int
    removed: int
    total: int
    problems: tuple[str, ...] = ()


@dataclass
class AuthorizedKeys:
    """Public keys (z85) allowed to connect; a pyzmq credentials provider."""

    directory: str
    keys: frozenset[bytes] = field(default_factory=frozenset)

    def load(self) -> KeyChange:
        """Re-read the directory's ``*.key`` files; unreadable files are skipped and named."""
        import zmq.auth

        problems: list[str] = []
        found: set[bytes] = set()
        if not os.path.isdir(self.directory):
            problems.append(f"{self.directory}: not a directory (every client key refused)")
        else:
            for path in sorted(glob.glob(os.path.join(glob.escape(self.directory), "*.key"))):
                try:
                    public, _ = zmq.auth.load_certificate(path)
                except (OSError, ValueError) as e:
                    problems.append(f"{path}: {e}")
                    continue
                if public:
                    found.add(bytes(public))
        old = self.keys
        self.keys = frozenset(found)  # one assignment: the ZAP thread sees the old or the new set
        change = KeyChange(added=len(self.keys - old), removed=len(old - self.keys), total=len(self.keys),
                           problems=tuple(problems))
        (log.warning if problems else log.info)(
            "curve_keys_loaded", directory=self.directory, keys=change.total, added=change.added,
            removed=change.removed, problems=list(problems))
        return change

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: may this client key (z85) connect?"""
        return bytes(key) in self.keys
