"""The embedded demo app: a deterministic, inference-shaped ASGI 3 app (no framework).

Routes:
- ``POST /v1/completions`` — OpenAI-style text completion.  CPU cost is
  proportional to ``max_tokens`` x number of prompts: a pure-Python integer
  mixing loop of ``ROUNDS_PER_TOKEN`` rounds per token, about 0.3 ms per token
  on the 2-core development VM (CPython 3.11: 0.21–0.38 ms when idle, up to
  0.48 ms with other load on the shared cores; ``measure_token_cost()``
  measures it on any machine).  The text is a function of the prompt only
  (blake2b seed), so replies can be compared across workers.  The loop yields
  to the event loop every ``YIELD_EVERY`` tokens so concurrent requests share
  the worker and heartbeats keep flowing, like a batched inference server.
- ``POST /v1/embeddings`` — OpenAI-style embeddings from a small numpy model
  (hashed bag of words → 8 tanh layers of 1024x1024 → 256-d unit vector;
  32 MiB of float32 weights).  Its cost is sub-linear in the batch size: one
  input is bound by reading the weights from memory, a batch reads them once
  for all its rows (about 2.6 ms for 1 input, 11 ms for 32 on the 2-core
  development VM), so concurrent requests are merged with
  ``numaserve.batching.batch`` (``NUMASERVE_DEMO_BATCH=0`` turns that off,
  ``NUMASERVE_DEMO_MAX_BATCH`` sets the size, default 32; window 5 ms).
  Deterministic per input (up to float rounding), so it is declared
  cacheable with ``[cache] deterministic_paths = ["/v1/embeddings"]``.
  Needs numpy (503 with a reason when it is missing).
- ``GET /v1/models`` — OpenAI list shape with the one demo model.
- ``GET /`` — where am I: slot, node, pid, generation, cpus, mempolicy,
  hostname (from the ``NUMASERVE_*`` variables the supervisor sets).
- ``GET /healthz`` — 200 ``ok``.

Errors use the OpenAI error shape: bad JSON / parameters 400, unknown path
404, wrong method 405 with ``Allow``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import time
from typing import Any, Awaitable, Callable, MutableMapping

from numaserve.cpulist import ListSyntaxError, parse_list

__all__ = [
    "MAX_PROMPTS",
    "MAX_REQUEST_BYTES",
    "MAX_TOKENS_LIMIT",
    "MODEL_ID",
    "ROUNDS_PER_TOKEN",
    "app",
    "complete",
    "generate",
    "measure_token_cost",
    "whoami",
]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

MODEL_ID = "numaserve-demo"
MAX_TOKENS_LIMIT = 4096
DEFAULT_MAX_TOKENS = 16
MAX_PROMPTS = 16
MAX_REQUEST_BYTES = 1 << 20
ROUNDS_PER_TOKEN = 1600
YIELD_EVERY = 16

_MASK = 0xFFFFFFFFFFFFFFFF
_VOCAB = (
    "the of and to in is that it for on with as was at by be this from or an are not have "
    "node socket memory core cache thread worker queue latency token model batch kernel page "
    "local remote bind policy affinity interrupt listener accept drain ready heartbeat stats "
    "supervisor slot generation request response stream tensor weight layer attention vector"
).split()


def _seed(prompt: str) -> int:
    return int.from_bytes(hashlib.blake2b(prompt.encode("utf-8", "surrogatepass"),
                                          digest_size=8).digest(), "little")


def _mix(state: int, rounds: int) -> int:
    """The per-token CPU work: an LCG step plus xorshift, ``rounds`` times."""
    for _ in range(rounds):
        state = (state * 6364136223846793005 + 1442695040888963407) & _MASK
        state ^= state >> 29
    return state


async def generate(prompt: str, max_tokens: int, rounds: int = ROUNDS_PER_TOKEN) -> str:
    """Deterministic text of ``max_tokens`` words for ``prompt`` (CPU-bound, yields)."""
    state = _seed(prompt)
    words: list[str] = []
    for i in range(max_tokens):
        state = _mix(state, rounds)
        words.append(_VOCAB[state % len(_VOCAB)])
        if (i + 1) % YIELD_EVERY == 0:
            await asyncio.sleep(0)
    return "".join(" " + w for w in words)


def measure_token_cost(tokens: int = 200, rounds: int = ROUNDS_PER_TOKEN) -> float:
    """Milliseconds of CPU per generated token on this machine."""
    t0 = time.perf_counter()
    state = 1
    for _ in range(tokens):
        state = _mix(state, rounds)
    return (time.perf_counter() - t0) * 1000.0 / tokens


def _count_tokens(text: str) -> int:
    """Prompt "tokens": whitespace-separated words (a demo, not a tokenizer)."""
    return len(text.split())


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


_completion_counter = 0


async def complete(body: dict[str, Any]) -> dict[str, Any]:
    """The ``/v1/completions`` reply for a decoded JSON body (raises _BadRequest)."""
    global _completion_counter
    if not isinstance(body, dict):
        raise _BadRequest("request body must be a JSON object")
    model = body.get("model", MODEL_ID)
    if not isinstance(model, str) or not model:
        raise _BadRequest("model must be a non-empty string", "model")
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise _BadRequest(f"at most {MAX_PROMPTS} prompts per request", "prompt")
        prompts = list(prompt)
    else:
        raise _BadRequest("prompt must be a string or a non-empty list of strings", "prompt")
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) \
            or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise _BadRequest(f"max_tokens must be an integer in 1..{MAX_TOKENS_LIMIT}", "max_tokens")
    if body.get("stream"):
        raise _BadRequest("stream is not supported by the demo app", "stream")
    choices = []
    for index, p in enumerate(prompts):
        text = await generate(p, max_tokens)
        choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": "length"})
    prompt_tokens = sum(_count_tokens(p) for p in prompts)
    completion_tokens = max_tokens * len(prompts)
    _completion_counter += 1
    return {
        "id": f"cmpl-{os.getpid()}-{_completion_counter}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def whoami() -> dict[str, Any]:
    """Where this worker runs, as the supervisor placed it (env) and as seen (pid, affinity)."""
    cpus: list[int] | None = None
    raw = os.environ.get("NUMASERVE_CPUS")
    if raw is not None:
        try:
            cpus = list(parse_list(raw))
        except ListSyntaxError:
            cpus = None
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0))
    return {
        "slot": _env_int("NUMASERVE_SLOT"),
        "node": _env_int("NUMASERVE_NODE"),
        "pid": os.getpid(),
        "generation": _env_int("NUMASERVE_GENERATION"),
        "cpus": cpus,
        "mempolicy": os.environ.get("NUMASERVE_MEMPOLICY"),
        "hostname": socket.gethostname(),
    }


def _models() -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "numaserve"}]}


# --- ASGI plumbing ---------------------------------------------------------------


async def _send_json(send: Send, status: int, obj: Any,
                     extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers.extend(extra_headers or ())
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _error(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _Disconnected(Exception):
    pass


async def _read_body(receive: Receive, limit: int | None = None) -> bytes | None:
    """The whole request body, or None if it exceeds ``limit``; raises if the client left."""
    if limit is None:
        limit = MAX_REQUEST_BYTES
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


_ROUTES: dict[str, tuple[str, ...]] = {
    "/": ("GET", "HEAD"),
    "/healthz": ("GET", "HEAD"),
    "/v1/models": ("GET", "HEAD"),
    "/v1/completions": ("POST",),
    "/v1/embeddings": ("POST",),
}


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """ASGI 3 entry point."""
    kind = scope["type"]
    if kind == "lifespan":
        await _lifespan(receive, send)
        return
    if kind != "http":
        raise RuntimeError(f"demo app does not handle {kind!r} scopes")
    path = scope["path"]
    method = scope["method"]
    allowed = _ROUTES.get(path)
    if allowed is None:
        await _send_json(send, 404, _error(f"no route for {path}", "not_found_error"))
        return
    if method not in allowed:
        await _send_json(send, 405, _error(f"method {method} not allowed on {path}",
                                           "invalid_request_error"),
                         [(b"allow", ", ".join(allowed).encode())])
        return
    if path == "/healthz":
        body = b"ok"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    elif path == "/":
        await _send_json(send, 200, whoami())
    elif path == "/v1/models":
        await _send_json(send, 200, _models())
    elif path == "/v1/embeddings":
        await _embeddings(receive, send)
    else:
        await _completions(receive, send)


_NO_BODY = object()


async def _read_json(receive: Receive, send: Send) -> Any:
    """The request body as JSON, or ``_NO_BODY`` after answering 413/400 (or a disconnect)."""
    try:
        raw = await _read_body(receive)
    except _Disconnected:
        return _NO_BODY  # nobody to answer
    if raw is None:
        await _send_json(send, 413, _error(f"request body over {MAX_REQUEST_BYTES} bytes",
                                           "invalid_request_error"))
        return _NO_BODY
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        await _send_json(send, 400, _error(f"invalid JSON body: {e}", "invalid_request_error"))
        return _NO_BODY


async def _completions(receive: Receive, send: Send) -> None:
    body = await _read_json(receive, send)
    if body is _NO_BODY:
        return
    try:
        reply = await complete(body)
    except _BadRequest as e:
        await _send_json(send, 400, _error(e.message, "invalid_request_error", e.param))
        return
    await _send_json(send, 200, reply)


# --- embeddings: a batched numpy model -------------------------------------------------

EMBED_HIDDEN = 1024
EMBED_LAYERS = 8
EMBED_DIM = 256
MAX_EMBED_INPUTS = 64
BATCHING = os.environ.get("NUMASERVE_DEMO_BATCH", "1") != "0"
_model_weights: Any = None


def _weights() -> Any:
    """The fixed random model (seeded), made on first use: hidden layers, then the projection."""
    global _model_weights
    if _model_weights is None:
        import numpy as np

        rng = np.random.default_rng(20240607)
        scale = np.float32(1.5 / np.sqrt(EMBED_HIDDEN))
        layers = [rng.standard_normal((EMBED_HIDDEN, EMBED_HIDDEN), dtype=np.float32) * scale
                  for _ in range(EMBED_LAYERS)]
        proj = rng.standard_normal((EMBED_HIDDEN, EMBED_DIM), dtype=np.float32) * scale
        _model_weights = (layers, proj)
    return _model_weights


def embed_many(texts: list[str]) -> list[Any]:
    """Unit vectors (float32 arrays) for ``texts``: one matmul for the whole list."""
    import numpy as np

    layers, proj = _weights()
    x = np.zeros((len(texts), EMBED_HIDDEN), dtype=np.float32)
    for i, text in enumerate(texts):
        for word in text.lower().split() or [""]:
            h = _seed(word)
            x[i, h % EMBED_HIDDEN] += 1.0 if (h >> 32) & 1 else -1.0
    for w in layers:
        x = np.tanh(x @ w)
    y = x @ proj
    y /= np.maximum(np.linalg.norm(y, axis=1, keepdims=True), 1e-6)
    return list(y)


async def _embed_unbatched(text: str) -> Any:
    return embed_many([text])[0]


def _make_batched() -> Any:
    from numaserve.batching import batch

    max_batch = _env_int("NUMASERVE_DEMO_MAX_BATCH") or 32

    @batch(max_batch=max_batch, max_wait_ms=5)
    async def embed_batched(texts: list[str]) -> list[Any]:
        # in a thread: the loop keeps reading requests (the next batch) while numpy runs
        return await asyncio.to_thread(embed_many, texts)

    return embed_batched


_embed_one: Any = None


def embed_one() -> Any:
    """The per-item entry point: batched unless ``NUMASERVE_DEMO_BATCH=0``."""
    global _embed_one
    if _embed_one is None:
        _embed_one = _make_batched() if BATCHING else _embed_unbatched
    return _embed_one


async def _embeddings(receive: Receive, send: Send) -> None:
    body = await _read_json(receive, send)
    if body is _NO_BODY:
        return
    inp = body.get("input") if isinstance(body, dict) else None
    texts = [inp] if isinstance(inp, str) else inp
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts) \
            or len(texts) > MAX_EMBED_INPUTS:
        await _send_json(send, 400, _error(f"input must be a string or a list of 1..{MAX_EMBED_INPUTS} strings",
                                           "invalid_request_error", "input"))
        return
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        await _send_json(send, 400, _error('encoding_format must be "float" or "base64"',
                                           "invalid_request_error", "encoding_format"))
        return
    try:
        import numpy  # noqa: F401
    except ImportError:
        await _send_json(send, 503, _error("the embeddings model needs numpy (pip install numpy)", "server_error"))
        return
    fn = embed_one()
    vectors = await asyncio.gather(*(fn(t) for t in texts))
    data = []
    for i, v in enumerate(vectors):
        if fmt == "base64":
            import base64

            emb: Any = base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
        else:
            emb = [round(float(f), 6) for f in v]
        data.append({"object": "embedding", "index": i, "embedding": emb})
    tokens = sum(_count_tokens(t) for t in texts)
    await _send_json(send, 200, {"object": "list", "data": data, "model": body.get("model") or MODEL_ID,
                                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
