"""The loaded model of this process and the thread pool its forward passes run on.

Loading (:func:`load`) is the ``--preload`` hook: in a node's warm template
it runs once and the workers forked from it share the weights; in an exec'd
worker (or without ``--preload``, from the app's lifespan startup) it runs
in the worker itself.  The weights file is named by ``NUMASERVE_MODEL``.

Threads: a template must stay single-threaded to fork, so numpy is imported
with its BLAS pool at one thread (``blas.py``) and no executor exists until
a worker asks for one.  In the worker, forward passes run on a pool of as many threads as
the worker's CPU affinity allows (its slot's CPUs), each with a one-thread
BLAS: concurrent requests use the slot's CPUs in parallel, and the worker
never runs more compute threads than it has CPUs.  The event loop stays free
while a forward pass runs (numpy releases the GIL in its matmuls).
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from numaserve.apps.model.network import Network
from numaserve.apps.model.tokenizer import Tokenizer
from numaserve.apps.model.weights import Weights, WeightsError, load_weights

from numaserve.progress import report_progress

__all__ = ["MODEL_ENV", "VERIFY_ENV", "Model", "current", "load", "loaded", "run", "slot_threads"]

MODEL_ENV = "NUMASERVE_MODEL"
VERIFY_ENV = "NUMASERVE_MODEL_VERIFY"   # "0": skip the CRC check (a large, trusted file loads faster)
T = TypeVar("T")


@dataclass
class Model:
    """What a request needs: the network, the tokenizer and the name the API shows."""

    weights: Weights
    network: Network
    tokenizer: Tokenizer
    model_id: str
    load_s: float


_model: Model | None = None
_pool: tuple[int, ThreadPoolExecutor] | None = None   # (pid that made it, pool)


def _progress(fraction: float, note: str) -> None:
    report_progress(fraction, note)   # a no-op outside a loading numaserve process


def model_id(path: str) -> str:
    """The API's model name: the file name without ``.safetensors``."""
    name = os.path.basename(path)
    return name[: -len(".safetensors")] if name.endswith(".safetensors") else name


def load() -> None:
    """The preload hook (``--preload numaserve.apps.model:load``): load ``$NUMASERVE_MODEL`` once.

    Raises :class:`WeightsError` (one line naming the file) for a missing or bad file;
    nothing is kept from a failed load.
    """
    global _model
    if _model is not None:
        return
    path = os.environ.get(MODEL_ENV, "")
    if not path:
        raise WeightsError(f"{MODEL_ENV} is not set: point it at a weights file made by "
                           "`numaserve model init PATH --size 2GB`")
    t0 = time.monotonic()
    _progress(0.0, f"loading {path}")
    weights = load_weights(path, _progress, verify=os.environ.get(VERIFY_ENV, "1") != "0")
    network = Network(weights.shape, weights.tensors)
    tokenizer = Tokenizer(weights.seed, weights.shape.words)
    _model = Model(weights, network, tokenizer, model_id(path), time.monotonic() - t0)
    from numaserve.log import get_logger

    s = weights.shape
    get_logger("numaserve.model").info(
        "model_loaded", path=path, bytes=weights.nbytes, load_s=round(_model.load_s, 3), d_model=s.d_model,
        layers=s.n_layers, heads=s.n_heads, vocab=s.vocab, ctx=s.ctx)


def loaded() -> bool:
    return _model is not None


def current() -> Model:
    """The loaded model; RuntimeError when neither the preload nor the lifespan loaded it."""
    if _model is None:
        raise RuntimeError("the model is not loaded")
    return _model


def slot_threads() -> int:
    """The worker's CPUs (its affinity): how many forward passes may run at once."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except OSError:
        return max(1, os.cpu_count() or 1)


def _executor() -> ThreadPoolExecutor:
    """This process's pool, made on first use (never in a template: it would stop the forks)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        try:
            from threadpoolctl import threadpool_limits

            threadpool_limits(limits=1, user_api="blas")  # parallelism comes from the pool below
        except ImportError:
            pass
        _pool = (os.getpid(), ThreadPoolExecutor(max_workers=slot_threads(), thread_name_prefix="model"))
    return _pool[1]


async def run(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the model's thread pool; the event loop goes on meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(_executor(), fn, *args)
