"""Micro-batching for async handlers: ``@batch(max_batch=32, max_wait_ms=5)``.

Decorate ``async def f(items: list[T]) -> list[R]`` (a function or a
method); callers then ``await f(item)`` with one item and get one result.
Calls that arrive while a batch is being gathered are merged: a batch runs
when it has ``max_batch`` items, or when its oldest item has waited
``max_wait_ms``, whichever comes first.  At most ``max_concurrent`` batches
run at once (default 1: while the model is busy new calls queue up and go in
the next, bigger batch — throughput grows with load, like continuous
batching); the rest wait in FIFO order.

Results and errors:

* the function must return a list as long as its input; element *i* goes to
  the caller of item *i*;
* an exception **raised** by the function fails every caller of that batch;
* an exception **object returned** as element *i* fails only caller *i*
  (per-item errors, e.g. one bad input);
* a wrong result length fails every caller with ``BatchResultError``.

Cancellation: a caller cancelled while waiting is dropped before its batch
runs; one cancelled while its batch runs has its result discarded; if every
caller of a running batch is cancelled the batch call itself is cancelled.
Nothing a cancelled caller does delays or fails the others.

State is per event loop (and per instance for methods), so a decorated
function can be used from several loops, one after the other or at once.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import weakref
from collections import deque
from typing import Any, Awaitable, Callable, Generic, TypeVar

__all__ = ["BatchResultError", "Batcher", "batch"]

T = TypeVar("T")
R = TypeVar("R")


class BatchResultError(RuntimeError):
    """The batched function returned something other than one result per item."""


class _Call:
    __slots__ = ("item", "future", "enqueued")

    def __init__(self, item: Any, future: asyncio.Future[Any], enqueued: float) -> None:
        self.item = item
        self.future = future
        self.enqueued = enqueued


class Batcher(Generic[T, R]):
    """The queue and scheduler for one function on one event loop."""

    def __init__(self, fn: Callable[[list[T]], Awaitable[list[R]]], max_batch: int, max_wait_s: float,
                 max_concurrent: int, loop: asyncio.AbstractEventLoop) -> None:
        self.fn = fn
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.max_concurrent = max_concurrent
        self.loop = loop
        self.pending: deque[_Call] = deque()
        self.running: set[asyncio.Task[None]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self.batches = 0          # counters, for tests and stats
        self.items = 0
        self.largest = 0

    async def submit(self, item: T) -> R:
        fut: asyncio.Future[R] = self.loop.create_future()
        self.pending.append(_Call(item, fut, self.loop.time()))
        self._schedule()
        return await fut

    # --- scheduling ----------------------------------------------------------------

    def _drop_cancelled_head(self) -> None:
        while self.pending and self.pending[0].future.done():
            self.pending.popleft()

    def _schedule(self) -> None:
        """Start every batch that is due and has a free slot; else arm the timer."""
        while True:
            self._drop_cancelled_head()
            if not self.pending or len(self.running) >= self.max_concurrent:
                break
            waited = self.loop.time() - self.pending[0].enqueued
            if len(self.pending) < self.max_batch and waited < self.max_wait_s:
                self._arm(self.max_wait_s - waited)
                return
            self._start()
        self._disarm()

    def _arm(self, delay: float) -> None:
        if self._timer is None:
            self._timer = self.loop.call_later(max(0.0, delay), self._on_timer)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self) -> None:
        self._timer = None
        self._schedule()

    def _start(self) -> None:
        calls: list[_Call] = []
        while self.pending and len(calls) < self.max_batch:
            c = self.pending.popleft()
            if not c.future.done():  # cancelled callers never reach the function
                calls.append(c)
        if not calls:
            return
        self.batches += 1
        self.items += len(calls)
        self.largest = max(self.largest, len(calls))
        task = self.loop.create_task(self._run(calls))
        self.running.add(task)
        task.add_done_callback(self._done)
        live = len(calls)

        def on_caller_done(f: asyncio.Future[Any]) -> None:
            nonlocal live
            if f.cancelled():
                live -= 1
                if live == 0 and not task.done():
                    task.cancel()  # nobody is waiting any more

        for c in calls:
            c.future.add_done_callback(on_caller_done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        self._schedule()

    async def _run(self, calls: list[_Call]) -> None:
        try:
            results = await self.fn([c.item for c in calls])
            if not isinstance(results, (list, tuple)) or len(results) != len(calls):
                got = f"{len(results)} results" if isinstance(results, (list, tuple)) else type(results).__name__
                raise BatchResultError(f"{getattr(self.fn, '__qualname__', self.fn)} returned {got} "
                                       f"for {len(calls)} items")
        except asyncio.CancelledError:
            for c in calls:
                if not c.future.done():
                    c.future.cancel()
            raise
        except BaseException as e:  # noqa: BLE001 - routed to every caller of the batch
            for c in calls:
                if not c.future.done():
                    c.future.set_exception(e)
            if not isinstance(e, Exception):
                raise
            return
        for c, r in zip(calls, results):
            if c.future.done():
                continue  # cancelled meanwhile: result discarded
            if isinstance(r, BaseException):
                c.future.set_exception(r)
            else:
                c.future.set_result(r)


class _Batched(Generic[T, R]):
    """What ``@batch`` returns: call with one item; works as a method too."""

    def __init__(self, fn: Callable[..., Awaitable[list[R]]], max_batch: int, max_wait_s: float,
                 max_concurrent: int, bound_to: Any = None) -> None:
        self.fn = fn
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.max_concurrent = max_concurrent
        self.bound_to = bound_to
        self._batchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Batcher[T, R]] = \
            weakref.WeakKeyDictionary()
        self._per_instance: weakref.WeakKeyDictionary[Any, _Batched[T, R]] = weakref.WeakKeyDictionary()
        functools.update_wrapper(self, fn)

    def batcher(self) -> Batcher[T, R]:
        """This loop's batcher (created on first use)."""
        loop = asyncio.get_running_loop()
        b = self._batchers.get(loop)
        if b is None:
            fn = self.fn if self.bound_to is None else functools.partial(self.fn, self.bound_to)
            b = Batcher(fn, self.max_batch, self.max_wait_s, self.max_concurrent, loop)
            self._batchers[loop] = b
        return b

    async def __call__(self, item: T) -> R:
        return await self.batcher().submit(item)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        bound = self._per_instance.get(obj)
        if bound is None:
            bound = _Batched(self.fn, self.max_batch, self.max_wait_s, self.max_concurrent, bound_to=obj)
            self._per_instance[obj] = bound
        return bound


def batch(max_batch: int = 32, max_wait_ms: float = 5.0, *,
          max_concurrent: int = 1) -> Callable[[Callable[..., Awaitable[list[Any]]]], Any]:
    """Decorator: merge concurrent single-item calls into list calls (see module docstring)."""
    if max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    if max_wait_ms < 0:
        raise ValueError("max_wait_ms must be >= 0")
    if max_concurrent < 1:
        raise ValueError("max_concurrent must be >= 1")

    def deco(fn: Callable[..., Awaitable[list[Any]]]) -> Any:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"@batch needs an async function, got {fn!r}")
        return _Batched(fn, max_batch, max_wait_ms / 1000.0, max_concurrent)

    return deco
