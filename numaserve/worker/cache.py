"""Per-worker response cache: LRU by entries and bytes, TTL, version epochs, purge.

What is cacheable: GET and HEAD requests, and POST to the paths listed in
``cache.deterministic_paths`` (exact, or a prefix ending in ``*``) — paths
whose answer is a pure function of the request, e.g. an embeddings model.
The key is a BLAKE2b-128 digest of method, path, query, body and the values
of ``cache.key_headers`` (e.g. ``authorization`` so users never see each
other's answers).  Only complete 200 responses are stored, and not when the
request or the response says ``Cache-Control: no-store`` (request
``no-cache`` skips the lookup but stores the fresh answer), when the
response is ``private``, sets a cookie, or ``Vary``s on a header that is not
part of the key.  A response ``max-age`` shorter than ``cache.ttl`` wins.

Epochs: ``set_version(v)`` (from ``numaserve cache bump``, a sticky
broadcast, so new workers start at it) drops every entry of older versions;
``purge(prefix)`` drops entries whose path starts with ``prefix``.  A request
that was already running when either happened does not store its answer, so
no pre-bump content survives the bump.

Answers from the cacheable path carry ``x-numaserve-cache: hit`` or ``miss``.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from typing import Any, Callable

import msgspec

from numaserve.config import CacheConfig
from numaserve.worker.asgi_types import Message, Receive, Scope, Send

__all__ = ["CacheConfig", "CacheEntry", "CacheMiddleware", "ResponseCache", "fingerprint"]


CACHE_HEADER = b"x-numaserve-cache"
#: Largest response body stored (bytes; also never more than ``cache.max_bytes``): a cache of small
#: deterministic answers, a big one would evict hundreds of them; larger responses pass through.
MAX_ENTRY_BYTES = 1024 * 1024


class CacheEntry(msgspec.Struct):
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    path: str
    version: int
    expires: float
    size: int


def fingerprint(method: str, path: str, query: bytes, body: bytes, key_headers: list[tuple[bytes, bytes]]) -> bytes:
    """128-bit BLAKE2b of the request parts, each length-prefixed (no ambiguity)."""
    h = hashlib.blake2b(digest_size=16)
    for part in (method.encode(), path.encode("utf-8", "surrogateescape"), query, body):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    for name, value in key_headers:
        h.update(len(name).to_bytes(2, "little") + name + len(value).to_bytes(8, "little") + value)
    return h.digest()


class ResponseCache:
    """The store: OrderedDict LRU, bounded by entry count and body+header bytes."""

    def __init__(self, cfg: CacheConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.version = 0
        self.purges = 0          # bumped by purge and set_version: in-flight stores are refused
        self._entries: OrderedDict[bytes, CacheEntry] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.stores = 0
        self.evictions = 0
        self.expired = 0
        self.purged = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> CacheEntry | None:
        """A fresh entry of the current version (moved to most recent), else None; counts."""
        e = self._entries.get(key)
        if e is not None and (e.version != self.version or e.expires <= self.clock()):
            self._drop(key)
            self.expired += 1
            e = None
        if e is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return e

    def put(self, key: bytes, entry: CacheEntry, epoch: tuple[int, int] | None = None) -> bool:
        """Store unless too big or the cache changed since ``epoch`` (``token()``); evicts LRU."""
        if epoch is not None and epoch != self.token():
            return False
        if entry.size > min(MAX_ENTRY_BYTES, self.cfg.max_bytes) or self.cfg.max_entries <= 0:
            return False
        if key in self._entries:
            self._drop(key)
        self._entries[key] = entry
        self.bytes += entry.size
        self.stores += 1
        while len(self._entries) > self.cfg.max_entries or self.bytes > self.cfg.max_bytes:
            old, _ = next(iter(self._entries.items()))
            self._drop(old)
            self.evictions += 1
        return True

    def token(self) -> tuple[int, int]:
        """Changes on every purge or version change (taken when a request starts)."""
        return (self.version, self.purges)

    def _drop(self, key: bytes) -> None:
        e = self._entries.pop(key)
        self.bytes -= e.size

    def purge(self, prefix: str = "") -> int:
        """Drop entries whose path starts with ``prefix`` ("" = all); returns how many."""
        self.purges += 1
        if not prefix:
            n = len(self._entries)
            self._entries.clear()
            self.bytes = 0
        else:
            doomed = [k for k, e in self._entries.items() if e.path.startswith(prefix)]
            for k in doomed:
                self._drop(k)
            n = len(doomed)
        self.purged += n
        return n

    def set_version(self, version: int) -> int:
        """Adopt epoch ``version``: older entries are dropped; returns how many."""
        if version == self.version:
            return 0
        self.version = version
        return self.purge("")

    def stats(self) -> dict[str, int]:
        """Counters for Stats ``extra`` (prefix ``cache_``)."""
        return {
            "cache_hits": self.hits,
            "cache_misses": self.misses,
            "cache_stores": self.stores,
            "cache_evictions": self.evictions,
            "cache_expired": self.expired,
            "cache_purged": self.purged,
            "cache_entries": len(self._entries),
            "cache_bytes": self.bytes,
            "cache_version": self.version,
        }


def _directives(value: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in value.decode("latin-1").lower().split(","):
        name, _, arg = part.strip().partition("=")
        if name:
            out[name] = arg.strip().strip('"')
    return out


class CacheMiddleware:
    """ASGI middleware answering cacheable requests from a ``ResponseCache``."""

    def __init__(self, app: Any, cache: ResponseCache) -> None:
        self.app = app
        self.cache = cache
        cfg = cache.cfg
        self._key_headers = {h.lower().encode("latin-1") for h in cfg.key_headers}
        self._exact = {p for p in cfg.deterministic_paths if not p.endswith("*")}
        self._prefixes = tuple(p[:-1] for p in cfg.deterministic_paths if p.endswith("*"))

    def _cacheable(self, method: str, path: str) -> bool:
        if method in ("GET", "HEAD"):
            return True
        return method == "POST" and (path in self._exact or (bool(self._prefixes) and path.startswith(self._prefixes)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._cacheable(scope["method"], scope["path"]):
            await self.app(scope, receive, send)
            return
        req_cc: dict[str, str] = {}
        key_headers: list[tuple[bytes, bytes]] = []
        for name, value in scope.get("headers", ()):
            if name == b"cache-control":
                req_cc.update(_directives(value))
            elif name in self._key_headers:
                key_headers.append((name, value))
        if "no-store" in req_cc:
            await self.app(scope, receive, send)
            return
        key_headers.sort()
        body = b""
        if scope["method"] == "POST":
            body, receive = await self._read_body(receive)
            if body is None:  # client left while sending
                return
        cache = self.cache
        key = fingerprint(scope["method"], scope["path"], scope.get("query_string", b""), body, key_headers)
        if "no-cache" not in req_cc:
            entry = cache.get(key)
            if entry is not None:
                await self._answer(send, entry, scope["method"] == "HEAD")
                return
        else:
            cache.misses += 1
        await self._miss(scope, receive, send, key)

    async def _read_body(self, receive: Receive) -> tuple[Any, Receive]:
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, receive
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return body, replay

    async def _answer(self, send: Send, e: CacheEntry, head: bool) -> None:
        await send({"type": "http.response.start", "status": e.status,
                    "headers": [*e.headers, (CACHE_HEADER, b"hit")]})
        await send({"type": "http.response.body", "body": b"" if head else e.body, "more_body": False})

    async def _miss(self, scope: Scope, receive: Receive, send: Send, key: bytes) -> None:
        cache = self.cache
        token = cache.token()
        limit = min(MAX_ENTRY_BYTES, cache.cfg.max_bytes)
        status = 0
        headers: list[tuple[bytes, bytes]] = []
        chunks: list[bytes] = []
        size = 0
        storable = True
        ttl = cache.cfg.ttl

        async def caching_send(message: Message) -> None:
            nonlocal status, headers, size, storable, ttl
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", ())]
                storable, ttl = self._storable(status, headers, ttl)
                message = dict(message)
                message["headers"] = [*headers, (CACHE_HEADER, b"miss")]
            elif message["type"] == "http.response.body" and storable:
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    storable = False
                    chunks.clear()
                elif chunk:
                    chunks.append(bytes(chunk))
                if not message.get("more_body", False) and storable:
                    body = b"".join(chunks)
                    entry_size = len(body) + sum(len(k) + len(v) for k, v in headers) + 64
                    cache.put(key, CacheEntry(status=status, headers=headers, body=body, path=scope["path"],
                                              version=token[0], expires=cache.clock() + ttl, size=entry_size),
                              epoch=token)
            await send(message)

        await self.app(scope, receive, caching_send)

    def _storable(self, status: int, headers: list[tuple[bytes, bytes]], ttl: float) -> tuple[bool, float]:
        if status != 200 or ttl <= 0:
            return False, ttl
        for name, value in headers:
            if name == b"cache-control":
                cc = _directives(value)
                if "no-store" in cc or "no-cache" in cc or "private" in cc:
                    return False, ttl
                for d in ("s-maxage", "max-age"):
                    if d in cc:
                        try:
                            ttl = min(ttl, float(cc[d]))
                        except ValueError:
                            return False, ttl
                        break
            elif name == b"set-cookie":
                return False, ttl
            elif name == b"vary":
                fields = {f.strip().lower() for f in value.decode("latin-1").split(",")}
                if "*" in fields or not {f.encode() for f in fields} <= self._key_headers:
                    return False, ttl
        return ttl > 0, ttl
