"""Response cache: store bounds, TTL, epochs, purge, the ASGI middleware, control commands."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from numaserve.control.messages import Ack, Command
from numaserve.worker import cache as cache_mod
from numaserve.worker.cache import CacheConfig, CacheEntry, CacheMiddleware, ResponseCache, fingerprint
from numaserve.worker.control import CommandDispatcher


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def entry(path: str = "/a", size: int = 10, version: int = 0, expires: float = 1e9) -> CacheEntry:
    return CacheEntry(status=200, headers=[], body=b"x" * size, path=path, version=version, expires=expires, size=size)


def test_fingerprint_covers_every_part() -> None:
    base = fingerprint("GET", "/a", b"q=1", b"", [(b"accept", b"x")])
    assert len(base) == 16
    for other in (fingerprint("HEAD", "/a", b"q=1", b"", [(b"accept", b"x")]),
                  fingerprint("GET", "/b", b"q=1", b"", [(b"accept", b"x")]),
                  fingerprint("GET", "/a", b"q=2", b"", [(b"accept", b"x")]),
                  fingerprint("GET", "/a", b"q=1", b"b", [(b"accept", b"x")]),
                  fingerprint("GET", "/a", b"q=1", b"", [(b"accept", b"y")]),
                  fingerprint("GET", "/a", b"q=", b"1", [(b"accept", b"x")])):  # no ambiguity at boundaries
        assert other != base


def test_lru_by_entries_and_by_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_mod, "MAX_ENTRY_BYTES", 60)
    c = ResponseCache(CacheConfig(max_entries=3, max_bytes=100))
    for k in (b"1", b"2", b"3"):
        c.put(k, entry(size=10))
    assert c.get(b"1") is not None  # 1 is now most recent
    c.put(b"4", entry(size=10))
    assert c.get(b"2") is None and len(c) == 3 and c.evictions == 1
    c.put(b"5", entry(size=60))  # 90 > 100? no: 10+10+10+60=90... evicts by count
    assert len(c) == 3 and c.bytes <= 100
    c.put(b"6", entry(size=60))
    assert c.bytes <= 100
    assert not c.put(b"big", entry(size=61))  # over MAX_ENTRY_BYTES: never stored
    assert not ResponseCache(CacheConfig(max_bytes=50)).put(b"big", entry(size=51))  # over max_bytes: never
    assert c.stats()["cache_entries"] == len(c)


def test_ttl_expiry() -> None:
    clock = Clock()
    c = ResponseCache(CacheConfig(), clock=clock)
    c.put(b"k", entry(expires=clock.t + 60))
    assert c.get(b"k") is not None
    clock.t += 61
    assert c.get(b"k") is None and c.expired == 1 and len(c) == 0


def test_version_bump_and_purge() -> None:
    c = ResponseCache(CacheConfig())
    c.put(b"a", entry("/v1/a"))
    c.put(b"b", entry("/v1/b"))
    c.put(b"c", entry("/other"))
    assert c.purge("/v1/") == 2 and len(c) == 1
    token = c.token()
    assert c.set_version(1) == 1 and len(c) == 0
    assert not c.put(b"late", entry(version=0), epoch=token)  # a request from before the bump
    assert c.put(b"new", entry(version=1), epoch=c.token())
    assert c.get(b"new") is not None


# --- middleware ---------------------------------------------------------------------

class App:
    """Counts calls; answers per path."""

    def __init__(self) -> None:
        self.calls = 0
        self.gate: asyncio.Event | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.calls += 1
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        if self.gate is not None:
            await self.gate.wait()
        path = scope["path"]
        status = 404 if path == "/404" else 200
        headers = [(b"content-type", b"text/plain")]
        if path == "/nostore":
            headers.append((b"cache-control", b"no-store"))
        if path == "/cookie":
            headers.append((b"set-cookie", b"a=b"))
        if path == "/vary":
            headers.append((b"vary", b"Accept, User-Agent"))
        if path == "/short":
            headers.append((b"cache-control", b"max-age=0"))
        out = f"{self.calls}:{scope['method']}:{path}:".encode() + body
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": out[:3], "more_body": True})
        await send({"type": "http.response.body", "body": out[3:], "more_body": False})


async def call(mw: Any, method: str, path: str, body: bytes = b"",
               headers: list[tuple[bytes, bytes]] | None = None) -> tuple[int, dict[bytes, bytes], bytes]:
    scope = {"type": "http", "method": method, "path": path, "query_string": b"", "headers": headers or []}
    chunks = [{"type": "http.request", "body": body[:2], "more_body": True},
              {"type": "http.request", "body": body[2:], "more_body": False}]

    async def receive() -> dict[str, Any]:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    out: dict[str, Any] = {"body": b""}

    async def send(m: dict[str, Any]) -> None:
        if m["type"] == "http.response.start":
            out["status"], out["headers"] = m["status"], dict(m["headers"])
        else:
            out["body"] += m.get("body", b"")

    await mw(scope, receive, send)
    return out["status"], out["headers"], out["body"]


def mw_with(**cfg: Any) -> tuple[CacheMiddleware, App]:
    app = App()
    return CacheMiddleware(app, ResponseCache(CacheConfig(enabled=True, **cfg))), app


def test_get_is_cached_with_hit_miss_header() -> None:
    async def main() -> None:
        mw, app = mw_with()
        s1, h1, b1 = await call(mw, "GET", "/x")
        s2, h2, b2 = await call(mw, "GET", "/x")
        assert (s1, s2, b1, b2) == (200, 200, b"1:GET:/x:", b"1:GET:/x:")
        assert h1[b"x-numaserve-cache"] == b"miss" and h2[b"x-numaserve-cache"] == b"hit"
        assert app.calls == 1
        _, h3, b3 = await call(mw, "HEAD", "/x")
        assert app.calls == 2 and h3[b"x-numaserve-cache"] == b"miss"
    asyncio.run(main())


def test_post_only_on_deterministic_paths_and_body_is_in_the_key() -> None:
    async def main() -> None:
        mw, app = mw_with(deterministic_paths=["/v1/embeddings", "/det/*"])
        for _ in range(2):
            _, h, b = await call(mw, "POST", "/v1/embeddings", b'{"input":"a"}')
        assert h[b"x-numaserve-cache"] == b"hit" and b.endswith(b'{"input":"a"}') and app.calls == 1
        _, h, b = await call(mw, "POST", "/v1/embeddings", b'{"input":"b"}')
        assert h[b"x-numaserve-cache"] == b"miss" and b.endswith(b'{"input":"b"}')  # body replayed to the app
        await call(mw, "POST", "/det/x", b"1")
        _, h, _ = await call(mw, "POST", "/det/x", b"1")
        assert h[b"x-numaserve-cache"] == b"hit"
        _, h, _ = await call(mw, "POST", "/v1/completions", b"1")
        assert b"x-numaserve-cache" not in h
    asyncio.run(main())


def test_key_headers_separate_users() -> None:
    async def main() -> None:
        mw, app = mw_with()
        await call(mw, "GET", "/me", headers=[(b"authorization", b"Bearer a")])
        _, h, _ = await call(mw, "GET", "/me", headers=[(b"authorization", b"Bearer b")])
        assert h[b"x-numaserve-cache"] == b"miss"
        _, h, _ = await call(mw, "GET", "/me", headers=[(b"authorization", b"Bearer a"), (b"x-other", b"1")])
        assert h[b"x-numaserve-cache"] == b"hit"
    asyncio.run(main())


def test_cache_control_and_uncacheable_answers() -> None:
    async def main() -> None:
        mw, app = mw_with()
        for path in ("/404", "/nostore", "/cookie", "/vary", "/short"):
            await call(mw, "GET", path)
            _, h, _ = await call(mw, "GET", path)
            assert h[b"x-numaserve-cache"] == b"miss", path
        await call(mw, "GET", "/r")
        _, h, _ = await call(mw, "GET", "/r", headers=[(b"cache-control", b"no-cache")])
        assert h[b"x-numaserve-cache"] == b"miss"  # revalidated
        _, h, _ = await call(mw, "GET", "/r", headers=[(b"cache-control", b"no-store")])
        assert b"x-numaserve-cache" not in h  # bypassed entirely
        mw2, _ = mw_with(key_headers=["accept", "user-agent"])
        await call(mw2, "GET", "/vary")
        _, h, _ = await call(mw2, "GET", "/vary")
        assert h[b"x-numaserve-cache"] == b"hit"  # varies only on key headers: fine
    asyncio.run(main())


def test_response_in_flight_during_purge_is_not_stored() -> None:
    async def main() -> None:
        mw, app = mw_with()
        app.gate = asyncio.Event()
        t = asyncio.ensure_future(call(mw, "GET", "/slow"))
        await asyncio.sleep(0.01)
        mw.cache.set_version(5)
        app.gate.set()
        await t
        assert len(mw.cache) == 0
        await call(mw, "GET", "/slow")
        assert len(mw.cache) == 1 and mw.cache.stats()["cache_version"] == 5
    asyncio.run(main())


def test_oversized_response_is_passed_through_not_stored() -> None:
    async def main() -> None:
        mw, app = mw_with(max_bytes=5)
        _, _, b = await call(mw, "GET", "/long-path-over-five-bytes")
        assert b.startswith(b"1:GET") and len(mw.cache) == 0
    asyncio.run(main())


# --- control commands -------------------------------------------------------------------

class Actions:
    def __init__(self, cache: ResponseCache | None) -> None:
        self.cache = cache

    def request_stop(self, deadline: float, reason: str) -> None: ...

    def request_drain(self, deadline: float) -> None: ...


def test_cache_commands_are_acknowledged() -> None:
    cache = ResponseCache(CacheConfig(enabled=True))
    cache.put(b"a", entry("/v1/a"))
    cache.put(b"b", entry("/x"))
    acks: list[Ack] = []
    d = CommandDispatcher(0, 1, Actions(cache), acks.append)  # type: ignore[arg-type]
    d.handle(Command(id="p1", name="cache_purge", args={"prefix": "/v1"}))
    d.handle(Command(id="v1", name="cache_version", args={"version": 3}))
    d.handle(Command(id="v0", name="cache_version", args={"version": 2}))
    d.handle(Command(id="bad", name="cache_version", args={"version": "x"}))
    assert [(a.ref, a.ok) for a in acks] == [("p1", True), ("v1", True), ("v0", True), ("bad", False)]
    assert "purged 1" in acks[0].detail and cache.version == 3 and len(cache) == 0
    assert "kept" in acks[2].detail
    acks.clear()
    off = CommandDispatcher(0, 1, Actions(None), acks.append)  # type: ignore[arg-type]
    off.handle(Command(id="p", name="cache_purge", args={}))
    assert acks[0].ok and "disabled" in acks[0].detail
