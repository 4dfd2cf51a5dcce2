"""Scenario "model": the reference model app (numaserve.apps.model) on numaserve,
``uvicorn --workers 2`` and ``gunicorn --preload -w 2`` (issue 31).

The same weights file for every server (made once with ``numaserve model init``):

- *streams*: 2 workers; for 1, 4 and 16 concurrent clients, each client asks
  for one streamed chat completion after the other (``max_tokens`` tokens,
  new connection each) for ``duration`` seconds.  Reported: generated tokens/s
  (every content chunk received, over the wall time until the last stream
  ended), time to first token p50/p99 (request sent -> first content chunk),
  failed streams.  The load generator runs on the same CPUs as the servers
  (a shared, 2-CPU machine): it costs every server the same.
- *load to ready*: from spawn to every worker ready (numaserve: ``status``;
  peers: each worker's "Application startup complete") — this is where each
  process loads (or, forked, inherits) the weights.
- *memory*: the whole process tree's PSS after it is ready and every worker
  answered a request, for 1/2/4/8 workers with a larger model (1 GB in full
  mode).  The issue-31 target, 4 workers: tree PSS <= 1.3 x weights + 4 x 80 MB.

Environment: ``BENCH_MODEL_SIZE`` (stream model, default 256MB; quick 32MB),
``BENCH_MODEL_MEM_SIZE`` (memory model, default 1GB; quick 128MB),
``BENCH_MODEL_WORKERS`` (default 1,2,4,8; quick 1,2).  In this scenario
"gunicorn" means ``gunicorn --preload`` (the app, and so the weights, loaded in
the master before the fork).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib.common import Ctx, summarize
from benchlib.scen_warm import tree_memory_mb
from benchlib.servers import Server, ServerConfig

CONCURRENCY = (1, 4, 16)
TARGET_PER_WORKER_MB = 80
TARGET_FACTOR = 1.3
PROMPT = [{"role": "user", "content": "which node holds the weights of this model?"}]


def _kinds(ctx: Ctx, rep: int) -> list[str]:
    wanted = {"gunicorn": "gunicorn-preload"}
    out = []
    for k in ctx.order(rep):
        k = wanted.get(k, k)
        if k in ("numaserve", "numaserve-exec", "uvicorn", "gunicorn-preload") and k not in out:
            out.append(k)
    return out


def _cfg(kind: str, workers: int, weights: Path) -> ServerConfig:
    env = {"NUMASERVE_MODEL": str(weights)}
    if kind.startswith("numaserve"):
        return ServerConfig(kind, workers=workers, app="numaserve.apps.model:app", env=env,
                            numaserve_args=("--preload", "numaserve.apps.model:load"))
    return ServerConfig(kind, workers=workers, app="modelapp:app", env=env)


def make_weights(size: str, where: Path) -> tuple[Path, int]:
    from numaserve.apps.model.shape import parse_size, shape_for_size
    from numaserve.apps.model.weights import init_weights

    path = where / f"model-{size}.safetensors"
    written = init_weights(str(path), shape_for_size(parse_size(size)), seed=31)
    return path, written


async def _streams(url: str, clients: int, duration: float, max_tokens: int) -> dict[str, Any]:
    import httpx

    body = {"model": "bench", "messages": PROMPT, "max_tokens": max_tokens, "stream": True}
    ttft: list[float] = []
    tokens = failed = done = 0
    t_start = time.perf_counter()
    stop_at = t_start + duration

    async def client() -> None:
        nonlocal tokens, failed, done
        async with httpx.AsyncClient(timeout=120.0, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                first: float | None = None
                n = 0
                try:
                    async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                        if r.status_code != 200:
                            await r.aread()
                            failed += 1
                            continue
                        async for line in r.aiter_lines():
                            if not line.startswith("data: {"):
                                continue
                            ch = json.loads(line[6:])["choices"]
                            if ch and ch[0]["delta"].get("content"):
                                n += 1
                                if first is None:
                                    first = time.perf_counter() - t0
                except (httpx.HTTPError, ValueError, KeyError):
                    failed += 1
                    continue
                tokens += n
                done += 1
                if first is not None:
                    ttft.append(first)

    await asyncio.gather(*(client() for _ in range(clients)))
    wall = time.perf_counter() - t_start
    q = statistics.quantiles(ttft, n=100, method="inclusive") if len(ttft) >= 2 else None
    return {"clients": clients, "tokens_per_s": round(tokens / wall, 1), "streams": done, "failed": failed,
            "ttft_p50_ms": round(1000 * statistics.median(ttft), 1) if ttft else None,
            "ttft_p99_ms": round(1000 * q[98], 1) if q else None, "wall_s": round(wall, 2)}


def _warm_every_worker(srv: Server, tries: int = 40) -> None:
    """One short completion per worker (a new connection each lands on any worker)."""
    import httpx

    seen: set[int] = set()
    want = len(srv.worker_pids())
    with httpx.Client(timeout=120.0, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        for _ in range(tries):
            c.post(srv.url + "/v1/completions", json={"prompt": "the node", "max_tokens": 2})
            seen.add(c.get(srv.url + "/").json()["pid"])
            if len(seen) >= want:
                return


def run(ctx: Ctx) -> dict[str, Any]:
    stream_size = os.environ.get("BENCH_MODEL_SIZE") or ctx.pick("32MB", "256MB")
    mem_size = os.environ.get("BENCH_MODEL_MEM_SIZE") or ctx.pick("128MB", "1GB")
    sizes = tuple(int(x) for x in os.environ.get("BENCH_MODEL_WORKERS", "").split(",") if x.strip()) \
        or ctx.pick((1, 2), (1, 2, 4, 8))
    duration = ctx.pick(3.0, 8.0)
    max_tokens = 32
    tmp = Path(tempfile.mkdtemp(prefix="bench-model-"))
    stream_raw: dict[tuple[str, int], list[dict[str, Any]]] = {}
    ready_raw: dict[str, list[dict[str, Any]]] = {}
    mem: dict[tuple[str, int], dict[str, Any]] = {}
    try:
        weights, stream_bytes = make_weights(stream_size, tmp)
        ctx.log(f"model: stream weights {stream_bytes / 1e6:.0f} MB")
        for rep in range(ctx.reps):
            for kind in _kinds(ctx, rep):
                with Server(_cfg(kind, 2, weights)).start() as srv:
                    ready = srv.wait_ready(timeout=600.0)
                    _warm_every_worker(srv)
                    ready.update(tree_memory_mb(srv.master_pid))
                    ready_raw.setdefault(kind, []).append(ready)
                    for c in CONCURRENCY:
                        r = asyncio.run(_streams(srv.url, c, duration, max_tokens))
                        stream_raw.setdefault((kind, c), []).append(r)
                        ctx.log(f"model rep {rep + 1} {kind:16} {c:2} streams: {r['tokens_per_s']} tok/s, TTFT p50 "
                                f"{r['ttft_p50_ms']} p99 {r['ttft_p99_ms']} ms, {r['streams']} streams, "
                                f"{r['failed']} failed")
                ctx.log(f"model rep {rep + 1} {kind:16} ready {ready['all_ready_s']} s, tree PSS "
                        f"{ready['tree_pss_mb']} MB")
        weights.unlink()
        big, mem_bytes = make_weights(mem_size, tmp)
        ctx.log(f"model: memory weights {mem_bytes / 1e6:.0f} MB")
        for kind in _kinds(ctx, 0):
            for w in sizes:
                with Server(_cfg(kind, w, big)).start() as srv:
                    ready = srv.wait_ready(timeout=900.0)
                    _warm_every_worker(srv)
                    time.sleep(1.0)
                    m = {"workers": w, **ready, **tree_memory_mb(srv.master_pid)}
                mem[(kind, w)] = m
                ctx.log(f"model memory {kind:16} {w} workers: ready {m['all_ready_s']} s, tree PSS "
                        f"{m['tree_pss_mb']} MB ({m['processes']} processes)")
        mem_mb = mem_bytes / 1048576
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for kind in ready_raw:
        row: dict[str, Any] = {"server": kind,
                               "all_ready_s": summarize(r["all_ready_s"] for r in ready_raw[kind]),
                               "tree_pss_mb": summarize(r["tree_pss_mb"] for r in ready_raw[kind])}
        for c in CONCURRENCY:
            rs = stream_raw.get((kind, c), [])
            row[f"c{c}"] = {k: summarize(r[k] for r in rs)
                            for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "failed")}
        rows.append(row)
    memory = [{"server": k, **m} for (k, _), m in sorted(mem.items())]
    limit = TARGET_FACTOR * mem_mb + 4 * TARGET_PER_WORKER_MB
    four = {k: m["tree_pss_mb"] for (k, w), m in mem.items() if w == 4}
    return {
        "title": "Model app: streaming chat, load to ready and memory (numaserve.apps.model)",
        "params": {"stream_weights_mb": round(stream_bytes / 1048576, 1), "mem_weights_mb": round(mem_mb, 1),
                   "max_tokens": max_tokens, "duration_s": duration, "concurrency": list(CONCURRENCY),
                   "reps": ctx.reps, "workers": list(sizes)},
        "rows": rows,
        "memory": memory,
        "target": {"four_workers_limit_mb": round(limit, 1),
                   "four_workers": {k: {"tree_pss_mb": v, "met": v <= limit} for k, v in four.items()}},
    }
