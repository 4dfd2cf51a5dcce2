"""@batch: merging, routing of results and errors, cancellation, limits (asyncio, no processes)."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from numaserve.batching import BatchResultError, batch


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_concurrent_calls_merge_and_results_route_back() -> None:
    seen: list[list[int]] = []

    @batch(max_batch=8, max_wait_ms=20)
    async def double(xs: list[int]) -> list[int]:
        seen.append(list(xs))
        await asyncio.sleep(0.001)
        return [x * 2 for x in xs]

    async def main() -> None:
        out = await asyncio.gather(*(double(i) for i in range(20)))
        assert out == [i * 2 for i in range(20)]
        assert [len(b) for b in seen] == [8, 8, 4]  # flushed at max_batch, then the remainder
        assert sorted(x for b in seen for x in b) == list(range(20))
    run(main())


def test_single_call_waits_at_most_max_wait() -> None:
    @batch(max_batch=100, max_wait_ms=30)
    async def ident(xs: list[int]) -> list[int]:
        return xs

    async def main() -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await ident(5) == 5
        assert 0.025 <= loop.time() - t0 < 0.5
    run(main())


def test_raised_exception_fails_the_whole_batch_only() -> None:
    calls = 0

    @batch(max_batch=4, max_wait_ms=5)
    async def f(xs: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if -1 in xs:
            raise ValueError("bad batch")
        return xs

    async def main() -> None:
        first = await asyncio.gather(*(f(x) for x in (1, -1, 2, 3)), return_exceptions=True)
        assert all(isinstance(r, ValueError) for r in first)
        assert await asyncio.gather(*(f(x) for x in (4, 5))) == [4, 5]  # the next batch is fine
    run(main())


def test_returned_exception_fails_only_its_caller() -> None:
    @batch(max_batch=4, max_wait_ms=5)
    async def f(xs: list[int]) -> list[Any]:
        return [KeyError(x) if x < 0 else x for x in xs]

    async def main() -> None:
        out = await asyncio.gather(*(f(x) for x in (1, -2, 3)), return_exceptions=True)
        assert out[0] == 1 and out[2] == 3 and isinstance(out[1], KeyError)
    run(main())


def test_wrong_result_length_fails_every_caller() -> None:
    @batch(max_batch=4, max_wait_ms=5)
    async def f(xs: list[int]) -> list[int]:
        return xs[:-1]

    async def main() -> None:
        out = await asyncio.gather(*(f(x) for x in (1, 2)), return_exceptions=True)
        assert all(isinstance(r, BatchResultError) for r in out)
    run(main())


def test_cancelled_waiter_is_dropped_before_the_batch_runs() -> None:
    seen: list[list[int]] = []

    @batch(max_batch=10, max_wait_ms=50)
    async def f(xs: list[int]) -> list[int]:
        seen.append(list(xs))
        return xs

    async def main() -> None:
        tasks = [asyncio.ensure_future(f(i)) for i in range(5)]
        await asyncio.sleep(0.01)
        tasks[1].cancel()
        tasks[3].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert [d for i, d in enumerate(done) if i not in (1, 3)] == [0, 2, 4]
        assert isinstance(done[1], asyncio.CancelledError)
        assert seen == [[0, 2, 4]]
    run(main())


def test_cancelled_while_running_discards_result_and_others_get_theirs() -> None:
    @batch(max_batch=3, max_wait_ms=1)
    async def slow(xs: list[int]) -> list[int]:
        await asyncio.sleep(0.1)
        return xs

    async def main() -> None:
        tasks = [asyncio.ensure_future(slow(i)) for i in range(3)]
        await asyncio.sleep(0.03)  # the batch is running
        tasks[0].cancel()
        out = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(out[0], asyncio.CancelledError) and out[1:] == [1, 2]
    run(main())


def test_all_callers_cancelled_cancels_the_batch_and_frees_the_slot() -> None:
    cancelled = []

    @batch(max_batch=2, max_wait_ms=1)
    async def slow(xs: list[int]) -> list[int]:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(xs)
            raise
        return xs

    @batch(max_batch=2, max_wait_ms=1)
    async def fast(xs: list[int]) -> list[int]:
        return xs

    async def main() -> None:
        tasks = [asyncio.ensure_future(slow(i)) for i in range(2)]
        await asyncio.sleep(0.02)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert cancelled == [[0, 1]]
        assert not slow.batcher().running and not slow.batcher().pending
        assert await fast(7) == 7
    run(main())


def test_max_concurrent_one_queues_and_grows_the_next_batch() -> None:
    sizes: list[int] = []
    active = 0
    peak = 0

    @batch(max_batch=64, max_wait_ms=2)
    async def model(xs: list[int]) -> list[int]:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        sizes.append(len(xs))
        await asyncio.sleep(0.02)
        active -= 1
        return xs

    async def client(i: int) -> None:
        for k in range(5):
            assert await model(i * 100 + k) == i * 100 + k

    async def main() -> None:
        await asyncio.gather(*(client(i) for i in range(30)))
        assert peak == 1
        assert max(sizes) >= 20  # under load batches fill up
        assert sum(sizes) == 150
    run(main())


def test_random_concurrency_and_cancellation_never_loses_or_leaks() -> None:
    rng = random.Random(7)

    @batch(max_batch=7, max_wait_ms=3, max_concurrent=2)
    async def f(xs: list[int]) -> list[Any]:
        await asyncio.sleep(rng.random() * 0.005)
        if 13 in xs:
            raise RuntimeError("unlucky batch")
        return [ValueError(x) if x % 11 == 0 else x + 1 for x in xs]

    async def one(x: int) -> Any:
        t = asyncio.ensure_future(f(x))
        if x % 5 == 0:
            await asyncio.sleep(rng.random() * 0.004)
            t.cancel()
        try:
            return await t
        except asyncio.CancelledError:
            return "cancelled"
        except Exception as e:  # noqa: BLE001
            return e

    async def main() -> None:
        out = await asyncio.gather(*(one(x) for x in range(1, 400)))
        for x, r in zip(range(1, 400), out):
            if r == "cancelled":
                assert x % 5 == 0
            elif isinstance(r, RuntimeError):
                pass  # shared a batch with 13
            elif x % 11 == 0:
                assert isinstance(r, ValueError)
            else:
                assert r == x + 1
        b = f.batcher()
        await asyncio.sleep(0.02)
        assert not b.running and not b.pending
    run(main())


def test_methods_get_a_batcher_per_instance() -> None:
    class Model:
        def __init__(self, k: int) -> None:
            self.k = k
            self.calls = 0

        @batch(max_batch=10, max_wait_ms=5)
        async def predict(self, xs: list[int]) -> list[int]:
            self.calls += 1
            return [x * self.k for x in xs]

    async def main() -> None:
        a, b = Model(2), Model(3)
        out = await asyncio.gather(*(a.predict(i) for i in range(4)), *(b.predict(i) for i in range(4)))
        assert out == [0, 2, 4, 6, 0, 3, 6, 9]
        assert a.calls == 1 and b.calls == 1
    run(main())


def test_works_on_successive_event_loops() -> None:
    @batch(max_batch=4, max_wait_ms=1)
    async def f(xs: list[int]) -> list[int]:
        return xs

    for _ in range(3):
        assert run(f(1)) == 1


def test_decorator_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        batch(max_batch=0)
    with pytest.raises(TypeError):
        batch()(lambda xs: xs)  # type: ignore[arg-type]


# --- the demo app's batched model ------------------------------------------------------------


async def _post(path: str, body: Any) -> tuple[int, Any]:
    import json

    from numaserve.apps.demo import app

    raw = json.dumps(body).encode()
    sent = False
    out: dict[str, Any] = {"body": b""}

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(m: dict[str, Any]) -> None:
        if m["type"] == "http.response.start":
            out["status"] = m["status"]
        else:
            out["body"] += m.get("body", b"")

    await app({"type": "http", "method": "POST", "path": path, "headers": []}, receive, send)
    return out["status"], json.loads(out["body"])


def test_demo_embeddings_shape_and_batching_of_concurrent_requests() -> None:
    pytest.importorskip("numpy")
    import numaserve.apps.demo as demo

    async def main() -> None:
        status, one = await _post("/v1/embeddings", {"input": "hello world", "model": "m"})
        assert status == 200 and one["object"] == "list" and one["model"] == "m"
        (item,) = one["data"]
        assert item["object"] == "embedding" and item["index"] == 0 and len(item["embedding"]) == demo.EMBED_DIM
        assert one["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
        results = await asyncio.gather(*(_post("/v1/embeddings", {"input": ["hello world", f"x {i}"]})
                                         for i in range(20)))
        assert all(s == 200 and len(r["data"]) == 2 for s, r in results)
        again = results[7][1]["data"][0]["embedding"]
        assert max(abs(a - b) for a, b in zip(again, item["embedding"])) < 1e-5  # same input, other batch
        b = demo.embed_one().batcher()
        assert b.largest > 1 and b.batches < b.items  # concurrent requests were merged
        status, enc = await _post("/v1/embeddings", {"input": "hello world", "encoding_format": "base64"})
        assert status == 200 and isinstance(enc["data"][0]["embedding"], str)
        for bad in ({"input": []}, {"input": [1]}, {"input": "x", "encoding_format": "hex"}, [1]):
            status, err = await _post("/v1/embeddings", bad)
            assert status == 400 and err["error"]["type"] == "invalid_request_error"

    demo._embed_one = None  # a fresh batcher for this loop
    run(main())
