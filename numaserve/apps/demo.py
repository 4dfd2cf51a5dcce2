"""The embedded demo app: a deterministic, inference-shaped ASGI 3 app (no framework).

It speaks the OpenAI HTTP API, so the official clients and the usual load
tools work against ``numaserve start`` out of the box:

- ``POST /v1/chat/completions`` and ``POST /v1/completions`` — a text
  "model" whose CPU cost is per generated token: a pure-Python integer
  mixing loop of ``ROUNDS_PER_TOKEN`` rounds per token, about 0.3 ms per
  token on the 2-core development VM (CPython 3.11: 0.21–0.38 ms when idle,
  up to 0.48 ms with other load on the shared cores; ``measure_token_cost()``
  measures it on any machine).  The text is a function of the prompt only
  (blake2b seed), so replies can be compared across workers and a longer
  completion extends a shorter one.  ``stream: true`` answers Server-Sent
  Events in OpenAI's chunk format, one chunk per token as it is generated,
  then ``data: [DONE]`` (``stream_options.include_usage``: the usage in a
  last chunk); otherwise one JSON response.  Also ``n``, ``stop`` (a
  generated word equal to a stop string ends that choice), a list of prompts
  (completions), ``max_completion_tokens`` (chat).  Generation is
  cooperative like a batched inference server: choices advance one token at
  a time together; a stream yields to the event loop after every token, a
  plain response every ``YIELD_EVERY`` tokens, so concurrent requests share
  the worker and heartbeats keep flowing.  A stream whose client left stops
  generating.
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
- ``GET /v1/models`` (and ``/v1/models/{id}``) — OpenAI list shape with the one demo model.
- ``GET /`` — where am I: slot, node, pid, generation, cpus, mempolicy,
  hostname (from the ``NUMASERVE_*`` variables the supervisor sets).
- ``GET /healthz`` — 200 ``ok``.

Errors use the OpenAI error shape: bad JSON / parameters 400 (``param``
names the field), unknown path or model id 404, wrong method 405 with
``Allow``.  Request and response shapes: ``numaserve.apps.openai_shapes``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import socket
import time
from typing import Any, Awaitable, Callable, Iterator, MutableMapping

from numaserve.apps import openai_shapes as oa
from numaserve.cpulist import ListSyntaxError, parse_list

__all__ = [
    # the ASGI plumbing the reference model app (numaserve.apps.model) serves with too
    "NO_BODY", "SSE_HEADERS", "read_json", "response_id", "send_json", "watch_disconnect",
    "MAX_PROMPTS",
    "MAX_REQUEST_BYTES",
    "MAX_TOKENS_LIMIT",
    "MODEL_ID",
    "ROUNDS_PER_TOKEN",
    "app",
    "chat",
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
MAX_PROMPTS = oa.MAX_CHOICES
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


def _token_words(seed_text: str, rounds: int = ROUNDS_PER_TOKEN) -> Iterator[str]:
    """The endless word stream for ``seed_text``; each word costs ``rounds`` of ``_mix``."""
    state = _seed(seed_text)
    while True:
        state = _mix(state, rounds)
        yield _VOCAB[state % len(_VOCAB)]


async def generate(prompt: str, max_tokens: int, rounds: int = ROUNDS_PER_TOKEN) -> str:
    """Deterministic text of ``max_tokens`` words for ``prompt`` (CPU-bound, yields)."""
    words = _token_words(prompt, rounds)
    out: list[str] = []
    for i in range(max_tokens):
        out.append(" " + next(words))
        if (i + 1) % YIELD_EVERY == 0:
            await asyncio.sleep(0)
    return "".join(out)


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


class _Choice:
    """One choice being generated: its word stream, text so far, how it ended."""

    __slots__ = ("finish", "pieces", "words")

    def __init__(self, seed_text: str) -> None:
        self.words = _token_words(seed_text)
        self.pieces: list[str] = []
        self.finish: str | None = None


OnToken = Callable[[int, str], Awaitable[None]]


async def _decode(req: oa.TextRequest, on_token: OnToken | None = None,
                  gone: asyncio.Event | None = None) -> list[_Choice]:
    """Generate every choice of ``req``, one token of each per step.

    Choice ``j`` of a prompt continues ``prompt`` (j = 0, the same text as
    n = 1) or ``prompt + NUL + j``.  ``on_token(index, piece)`` streams each
    token as it is made, and then the loop yields after every step; without
    it, every ``YIELD_EVERY`` steps.  ``gone`` set (the client left) stops
    the generation.
    """
    choices = [_Choice(p if j == 0 else f"{p}\x00{j}") for p in req.prompts for j in range(req.n)]
    lead = "" if req.kind == "chat" else " "  # chat content starts with the first word
    stop = set(req.stop)
    for step in range(req.max_tokens):
        live = False
        for index, c in enumerate(choices):
            if c.finish is not None:
                continue
            word = next(c.words)
            if word in stop:
                c.finish = "stop"
                continue
            piece = (" " if c.pieces else lead) + word
            c.pieces.append(piece)
            live = True
            if on_token is not None:
                await on_token(index, piece)
        if not live or (gone is not None and gone.is_set()):
            break
        if on_token is not None or (step + 1) % YIELD_EVERY == 0:
            await asyncio.sleep(0)
    for c in choices:
        if c.finish is None:
            c.finish = "length"
    return choices


_counter = 0


def response_id(kind: str) -> str:
    global _counter
    _counter += 1
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{os.getpid()}-{_counter}"


def _limits() -> dict[str, Any]:
    return {"default_model": MODEL_ID, "default_max_tokens": DEFAULT_MAX_TOKENS,
            "max_tokens_limit": MAX_TOKENS_LIMIT}


async def _reply(req: oa.TextRequest) -> dict[str, Any]:
    choices = await _decode(req)
    texts = ["".join(c.pieces) for c in choices]
    finish = [c.finish or "length" for c in choices]
    tokens = sum(len(c.pieces) for c in choices)
    build = oa.chat_response if req.kind == "chat" else oa.completion_response
    return build(req, response_id(req.kind), int(time.time()), texts, finish, tokens)


async def complete(body: Any) -> dict[str, Any]:
    """The non-streamed ``/v1/completions`` reply for a decoded JSON body (raises BadRequest)."""
    req = oa.parse_completion(body, **_limits())
    return await _reply(req if not req.stream else _unstreamed(req))


async def chat(body: Any) -> dict[str, Any]:
    """The non-streamed ``/v1/chat/completions`` reply for a decoded JSON body (raises BadRequest)."""
    req = oa.parse_chat(body, **_limits())
    return await _reply(req if not req.stream else _unstreamed(req))


def _unstreamed(req: oa.TextRequest) -> oa.TextRequest:
    return dataclasses.replace(req, stream=False, include_usage=False)


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


def _model() -> dict[str, Any]:
    return {"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "numaserve"}


def _models() -> dict[str, Any]:
    return {"object": "list", "data": [_model()]}


# --- ASGI plumbing ---------------------------------------------------------------


async def send_json(send: Send, status: int, obj: Any,
                     extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers.extend(extra_headers or ())
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


_error = oa.error


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
    "/v1/chat/completions": ("POST",),
    "/v1/embeddings": ("POST",),
}
_MODEL_PREFIX = "/v1/models/"


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
    if allowed is None and path.startswith(_MODEL_PREFIX) and method in ("GET", "HEAD"):
        model = path[len(_MODEL_PREFIX):]
        if model == MODEL_ID:
            await send_json(send, 200, _model())
        else:
            await send_json(send, 404, _error(f"The model '{model}' does not exist", "invalid_request_error",
                                               "model", "model_not_found"))
        return
    if allowed is None:
        await send_json(send, 404, _error(f"no route for {path}", "not_found_error"))
        return
    if method not in allowed:
        await send_json(send, 405, _error(f"method {method} not allowed on {path}",
                                           "invalid_request_error"),
                         [(b"allow", ", ".join(allowed).encode())])
        return
    if path == "/healthz":
        body = b"ok"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    elif path == "/":
        await send_json(send, 200, whoami())
    elif path == "/v1/models":
        await send_json(send, 200, _models())
    elif path == "/v1/embeddings":
        await _embeddings(receive, send)
    else:
        await _text(path == "/v1/chat/completions", receive, send)


NO_BODY = object()


async def read_json(receive: Receive, send: Send) -> Any:
    """The request body as JSON, or ``NO_BODY`` after answering 413/400 (or a disconnect)."""
    try:
        raw = await _read_body(receive)
    except _Disconnected:
        return NO_BODY  # nobody to answer
    if raw is None:
        await send_json(send, 413, _error(f"request body over {MAX_REQUEST_BYTES} bytes",
                                           "invalid_request_error"))
        return NO_BODY
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        await send_json(send, 400, _error(f"invalid JSON body: {e}", "invalid_request_error"))
        return NO_BODY
    except RecursionError:   # e.g. 100,000 nested arrays: the client's error, not a 500
        await send_json(send, 400, _error("invalid JSON body: nested too deeply", "invalid_request_error"))
        return NO_BODY


async def _text(is_chat: bool, receive: Receive, send: Send) -> None:
    """``/v1/chat/completions`` and ``/v1/completions``: one JSON reply or an SSE stream."""
    body = await read_json(receive, send)
    if body is NO_BODY:
        return
    try:
        req = (oa.parse_chat if is_chat else oa.parse_completion)(body, **_limits())
    except oa.BadRequest as e:
        await send_json(send, 400, _error(e.message, "invalid_request_error", e.param))
        return
    if not req.stream:
        await send_json(send, 200, await _reply(req))
        return
    gone = asyncio.Event()
    watcher = asyncio.ensure_future(watch_disconnect(receive, gone))
    try:
        await _stream(req, send, gone)
    finally:
        watcher.cancel()


async def watch_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    """The body is read: the next message is ``http.disconnect`` when the client leaves."""
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


async def _stream(req: oa.TextRequest, send: Send, gone: asyncio.Event) -> None:
    """SSE in OpenAI's chunk format: a chunk per token, finish chunks, usage if asked, [DONE]."""
    rid, created = response_id(req.kind), int(time.time())
    chat = req.kind == "chat"

    async def event(obj: Any) -> None:
        await send({"type": "http.response.body", "body": oa.sse(obj), "more_body": True})

    async def on_token(index: int, piece: str) -> None:
        if not gone.is_set():
            await event(oa.chat_chunk(req, rid, created, index, {"content": piece}, None) if chat
                        else oa.completion_chunk(req, rid, created, index, piece, None))

    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    if chat:  # the first chunk of each choice names the role
        for index in range(req.choices):
            await event(oa.chat_chunk(req, rid, created, index, {"role": "assistant", "content": ""}, None))
    choices = await _decode(req, on_token, gone)
    if gone.is_set():
        return  # nobody to finish for: uvicorn ends the exchange
    for index, c in enumerate(choices):
        await event(oa.chat_chunk(req, rid, created, index, {}, c.finish) if chat
                    else oa.completion_chunk(req, rid, created, index, "", c.finish))
    if req.include_usage:
        await event(oa.usage_chunk(req, rid, created, sum(len(c.pieces) for c in choices)))
    await send({"type": "http.response.body", "body": oa.SSE_DONE, "more_body": False})


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
    body = await read_json(receive, send)
    if body is NO_BODY:
        return
    inp = body.get("input") if isinstance(body, dict) else None
    texts = [inp] if isinstance(inp, str) else inp
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts) \
            or len(texts) > MAX_EMBED_INPUTS:
        await send_json(send, 400, _error(f"input must be a string or a list of 1..{MAX_EMBED_INPUTS} strings",
                                           "invalid_request_error", "input"))
        return
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        await send_json(send, 400, _error('encoding_format must be "float" or "base64"',
                                           "invalid_request_error", "encoding_format"))
        return
    try:
        import numpy
    except ImportError:
        await send_json(send, 503, _error("the embeddings model needs numpy (pip install numpy)", "server_error"))
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
    await send_json(send, 200, {"object": "list", "data": data, "model": body.get("model") or MODEL_ID,
                                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
