"""The reference model's ASGI app: the OpenAI endpoints of the demo, answered by the real network.

``POST /v1/chat/completions`` (``stream: true``: one SSE chunk per generated
token), ``POST /v1/completions``, ``POST /v1/embeddings`` (mean-pooled final
hidden states, unit length), ``GET /v1/models``, ``GET /`` (which worker
answered), ``GET /healthz``.  Request validation, response and chunk shapes
are the demo's (``numaserve.apps.openai_shapes``); so are the HTTP helpers.

Decoding is greedy, so a reply is a function of the prompt and the weights
(every worker answers alike).  Choice ``j > 0`` of ``n`` continues the prompt
followed by word token ``j``, so the choices differ.  A prompt longer than
the context keeps its last ``ctx - max_tokens`` tokens.  A stop string cuts
the text where it first appears (``finish_reason: "stop"``).  Every forward
step runs on the model's thread pool (:func:`numaserve.apps.model.engine.run`):
a stream costs one step per token, so concurrent streams interleave and the
event loop stays free.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import time
from typing import Any

from numaserve.apps import openai_shapes as oa
from numaserve.apps.demo import (
    NO_BODY,
    SSE_HEADERS,
    Receive,
    Scope,
    Send,
    read_json,
    response_id,
    send_json,
    watch_disconnect,
    whoami,
)
from numaserve.apps.model import engine
from numaserve.apps.model.shape import BYTE_TOKENS

__all__ = ["DEFAULT_MAX_TOKENS", "MAX_EMBED_INPUTS", "Decoder", "app"]

DEFAULT_MAX_TOKENS = 16
MAX_EMBED_INPUTS = 64


class Decoder:
    """One choice's greedy generation; ``step`` is synchronous (run it on the model's pool)."""

    def __init__(self, m: engine.Model, prompt: list[int], max_tokens: int, stop: tuple[str, ...],
                 lead_space: bool) -> None:
        ctx = m.network.shape.ctx
        self.m = m
        self.prompt = (prompt or [ord(" ")])[-max(1, ctx - max_tokens):]
        self.max_tokens = min(max_tokens, ctx - len(self.prompt))
        self.stop = stop
        self.lead_space = lead_space
        self.cache = m.network.new_cache(len(self.prompt) + self.max_tokens)
        self.text = ""
        self.tokens = 0
        self.finish: str | None = None
        self._next: list[int] = self.prompt

    def step(self) -> str:
        """Generate one token; the text it adds (may be empty when a stop string cut it)."""
        if self.finish is not None:
            return ""
        tok = self.m.network.next_token(self._next, self.cache)
        self._next = [tok]
        self.tokens += 1
        piece = self.m.tokenizer.piece(tok).decode()
        if not self.text and not self.lead_space:
            piece = piece.lstrip(" ")
        before = len(self.text)
        self.text += piece
        for s in self.stop:
            at = self.text.find(s, max(0, before - len(s) + 1))
            if at >= 0:
                self.text, self.finish = self.text[:at], "stop"
        if self.finish is None and self.tokens >= self.max_tokens:
            self.finish = "length"
        return self.text[before:]

    def run(self) -> str:
        """The whole generation (a non-streamed reply): one trip to the pool."""
        while self.finish is None:
            self.step()
        return self.text


def _limits(m: engine.Model) -> dict[str, Any]:
    return {"default_model": m.model_id, "default_max_tokens": DEFAULT_MAX_TOKENS,
            "max_tokens_limit": m.network.shape.ctx - 1}


def _decoders(m: engine.Model, req: oa.TextRequest) -> list[Decoder]:
    out = []
    for prompt in req.prompts:
        ids = m.tokenizer.encode(prompt)
        for j in range(req.n):
            out.append(Decoder(m, ids + ([BYTE_TOKENS + j] if j else []), req.max_tokens, req.stop,
                               lead_space=req.kind == "completion"))
    return out


def _model_card(m: engine.Model) -> dict[str, Any]:
    return {"id": m.model_id, "object": "model", "created": 0, "owned_by": "numaserve"}


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                if not engine.loaded():
                    engine.load()    # no --preload: this worker loads its own copy
            except Exception as e:  # a bad file or a missing variable: one line, the worker exits 3
                await send({"type": "lifespan.startup.failed", "message": f"{type(e).__name__}: {e}"})
                return
            await engine.run(int)    # the pool and its BLAS limit exist before the first request
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """ASGI 3 entry point (``--app numaserve.apps.model:app``)."""
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    if scope["type"] != "http":
        raise RuntimeError(f"the model app does not handle {scope['type']!r} scopes")
    path, method = scope["path"], scope["method"]
    if path == "/healthz" and method in ("GET", "HEAD"):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    if path == "/" and method in ("GET", "HEAD"):
        await send_json(send, 200, whoami())
        return
    if not engine.loaded():
        await send_json(send, 503, oa.error("the model is not loaded (lifespan off and no --preload?)",
                                             "server_error"))
        return
    m = engine.current()
    routes = {"/v1/models": "GET", "/v1/chat/completions": "POST", "/v1/completions": "POST",
              "/v1/embeddings": "POST"}
    if path.startswith("/v1/models/") and method in ("GET", "HEAD"):
        name = path[len("/v1/models/"):]
        if name == m.model_id:
            await send_json(send, 200, _model_card(m))
        else:
            await send_json(send, 404, oa.error(f"The model '{name}' does not exist", "invalid_request_error",
                                                 "model", "model_not_found"))
        return
    want = routes.get(path)
    if want is None:
        await send_json(send, 404, oa.error(f"no route for {path}", "not_found_error"))
        return
    if method != want and not (want == "GET" and method == "HEAD"):
        await send_json(send, 405, oa.error(f"method {method} not allowed on {path}", "invalid_request_error"),
                         [(b"allow", want.encode())])
        return
    if path == "/v1/models":
        await send_json(send, 200, {"object": "list", "data": [_model_card(m)]})
    elif path == "/v1/embeddings":
        await _embeddings(m, receive, send)
    else:
        await _text(m, path == "/v1/chat/completions", receive, send)


async def _text(m: engine.Model, is_chat: bool, receive: Receive, send: Send) -> None:
    body = await read_json(receive, send)
    if body is NO_BODY:
        return
    try:
        req = (oa.parse_chat if is_chat else oa.parse_completion)(body, **_limits(m))
    except oa.BadRequest as e:
        await send_json(send, 400, oa.error(e.message, "invalid_request_error", e.param))
        return
    req = dataclasses.replace(req, prompt_tokens=sum(len(m.tokenizer.encode(p)) for p in req.prompts))
    decoders = _decoders(m, req)
    if not req.stream:
        texts = await asyncio.gather(*(engine.run(d.run) for d in decoders))
        build = oa.chat_response if is_chat else oa.completion_response
        await send_json(send, 200, build(req, response_id(req.kind), int(time.time()), list(texts),
                                          [d.finish or "length" for d in decoders],
                                          sum(d.tokens for d in decoders)))
        return
    gone = asyncio.Event()
    watcher = asyncio.ensure_future(watch_disconnect(receive, gone))
    try:
        await _stream(req, decoders, send, gone)
    finally:
        watcher.cancel()


async def _stream(req: oa.TextRequest, decoders: list[Decoder], send: Send, gone: asyncio.Event) -> None:
    """SSE in OpenAI's chunk format: a chunk per token as each choice makes it, finish chunks, [DONE]."""
    rid, created, chat = response_id(req.kind), int(time.time()), req.kind == "chat"
    lock = asyncio.Lock()   # choices run concurrently; their chunks go out whole, one at a time

    async def event(obj: Any) -> None:
        async with lock:
            await send({"type": "http.response.body", "body": oa.sse(obj), "more_body": True})

    async def choice(index: int, d: Decoder) -> None:
        if chat:
            await event(oa.chat_chunk(req, rid, created, index, {"role": "assistant", "content": ""}, None))
        while d.finish is None and not gone.is_set():
            piece = await engine.run(d.step)
            if piece and not gone.is_set():
                await event(oa.chat_chunk(req, rid, created, index, {"content": piece}, None) if chat
                            else oa.completion_chunk(req, rid, created, index, piece, None))
        if not gone.is_set():
            await event(oa.chat_chunk(req, rid, created, index, {}, d.finish) if chat
                        else oa.completion_chunk(req, rid, created, index, "", d.finish))

    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    await asyncio.gather(*(choice(i, d) for i, d in enumerate(decoders)))
    if gone.is_set():
        return  # nobody to finish for
    if req.include_usage:
        await event(oa.usage_chunk(req, rid, created, sum(d.tokens for d in decoders)))
    await send({"type": "http.response.body", "body": oa.SSE_DONE, "more_body": False})


async def _embeddings(m: engine.Model, receive: Receive, send: Send) -> None:
    body = await read_json(receive, send)
    if body is NO_BODY:
        return
    inp = body.get("input") if isinstance(body, dict) else None
    texts = [inp] if isinstance(inp, str) else inp
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts) \
            or len(texts) > MAX_EMBED_INPUTS:
        await send_json(send, 400, oa.error(f"input must be a string or a list of 1..{MAX_EMBED_INPUTS} strings",
                                             "invalid_request_error", "input"))
        return
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        await send_json(send, 400, oa.error('encoding_format must be "float" or "base64"',
                                             "invalid_request_error", "encoding_format"))
        return
    ids = [m.tokenizer.encode(t) for t in texts]
    vectors = await asyncio.gather(*(engine.run(m.network.embed, i) for i in ids))
    data = []
    for i, v in enumerate(vectors):
        emb: Any = (base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") if fmt == "base64"
                    else [round(float(f), 6) for f in v])
        data.append({"object": "embedding", "index": i, "embedding": emb})
    tokens = sum(len(i) for i in ids)
    await send_json(send, 200, {"object": "list", "data": data, "model": body.get("model") or m.model_id,
                                 "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})
