"""The OpenAI HTTP API's request and response shapes, as the demo app speaks them (pure).

Requests are validated into a :class:`TextRequest` (or :class:`BadRequest`
with the parameter at fault, answered 400 in OpenAI's error shape);
responses and stream chunks are built as plain dicts.  Streams are
Server-Sent Events: one ``data: {json}`` event per chunk, then
``data: [DONE]``; with ``stream_options.include_usage`` every chunk carries
``"usage": null`` and one last chunk with empty ``choices`` carries the usage
— the format of ``POST /v1/chat/completions`` and ``/v1/completions`` that
the official clients parse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "MAX_CHOICES",
    "MAX_STOP",
    "SSE_DONE",
    "BadRequest",
    "TextRequest",
    "chat_chunk",
    "chat_prompt",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "error",
    "parse_chat",
    "parse_completion",
    "sse",
    "usage",
    "usage_chunk",
]

Kind = Literal["chat", "completion"]

#: Choices per request (prompts x n): bounds the work one request can ask for.
MAX_CHOICES = 16
MAX_STOP = 4
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
SSE_DONE = b"data: [DONE]\n\n"


class BadRequest(Exception):
    """A request the API refuses with 400; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class TextRequest:
    """A validated completion or chat request: what to generate and how to answer."""

    kind: Kind
    model: str
    prompts: tuple[str, ...]    # completions: one per prompt; chat: the conversation as text
    prompt_tokens: int
    max_tokens: int
    n: int
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


def error(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _count_tokens(text: str) -> int:
    """Prompt "tokens": whitespace-separated words (a demo, not a tokenizer)."""
    return len(text.split())


def _int_in(body: dict[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = body.get(name, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BadRequest(f"{name} must be an integer in {lo}..{hi}", name)
    return value


def _common(body: Any, default_model: str) -> tuple[str, int, bool, bool, tuple[str, ...]]:
    """model, n, stream, include_usage, stop — shared by both endpoints."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model", default_model)
    if not isinstance(model, str) or not model:
        raise BadRequest("model must be a non-empty string", "model")
    n = _int_in(body, "n", 1, 1, MAX_CHOICES)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("stream must be a boolean", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise BadRequest("stream_options must be an object with a boolean include_usage", "stream_options")
        include_usage = bool(options.get("include_usage", False))
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= MAX_STOP and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise BadRequest(f"stop must be a string or a list of at most {MAX_STOP} strings", "stop")
    return model, n, stream, include_usage, tuple(s for s in stops if s)


def _check_choices(prompts: int, n: int) -> None:
    if prompts * n > MAX_CHOICES:
        raise BadRequest(f"at most {MAX_CHOICES} choices per request (prompts x n)", "n")


def parse_completion(body: Any, *, default_model: str, default_max_tokens: int,
                     max_tokens_limit: int) -> TextRequest:
    """``POST /v1/completions``: prompt (a string or a list of strings), max_tokens, n, stream, stop."""
    model, n, stream, include_usage, stop = _common(body, default_model)
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        prompts = (prompt,)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) > MAX_CHOICES:
            raise BadRequest(f"at most {MAX_CHOICES} prompts per request", "prompt")
        prompts = tuple(prompt)
    else:
        raise BadRequest("prompt must be a string or a non-empty list of strings", "prompt")
    _check_choices(len(prompts), n)
    max_tokens = _int_in(body, "max_tokens", default_max_tokens, 1, max_tokens_limit)
    return TextRequest("completion", model, prompts, sum(_count_tokens(p) for p in prompts),
                       max_tokens, n, stream, include_usage, stop)


def _content_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest("the demo model reads text only: content parts must be "
                                 '{"type": "text", "text": "..."}', f"{where}.content[{i}]")
            parts.append(part["text"])
        return "\n".join(parts)
    raise BadRequest("content must be a string or a list of text parts", f"{where}.content")


def chat_prompt(messages: Any) -> str:
    """The conversation as the one text the model continues ("role: content" lines)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    lines = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest("each message must be an object with role and content", where)
        role = m.get("role")
        if role not in _ROLES:
            raise BadRequest(f"role must be one of {', '.join(_ROLES)}", f"{where}.role")
        lines.append(f"{role}: {_content_text(m.get('content'), where)}")
    return "\n".join(lines)


def parse_chat(body: Any, *, default_model: str, default_max_tokens: int, max_tokens_limit: int) -> TextRequest:
    """``POST /v1/chat/completions``: messages, max_completion_tokens (or max_tokens), n, stream, stop."""
    model, n, stream, include_usage, stop = _common(body, default_model)
    prompt = chat_prompt(body.get("messages"))
    _check_choices(1, n)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int_in(body, name, default_max_tokens, 1, max_tokens_limit)
    return TextRequest("chat", model, (prompt,), _count_tokens(prompt), max_tokens, n, stream, include_usage, stop)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(req: TextRequest, rid: str, created: int, texts: list[str], finish: list[str],
                        completion_tokens: int) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": req.model,
        "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": f}
                    for i, (t, f) in enumerate(zip(texts, finish))],
        "usage": usage(req.prompt_tokens, completion_tokens),
    }


def chat_response(req: TextRequest, rid: str, created: int, texts: list[str], finish: list[str],
                  completion_tokens: int) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": req.model,
        "choices": [{"index": i, "message": {"role": "assistant", "content": t, "refusal": None},
                     "logprobs": None, "finish_reason": f} for i, (t, f) in enumerate(zip(texts, finish))],
        "usage": usage(req.prompt_tokens, completion_tokens),
    }


def _chunk(req: TextRequest, obj: str, rid: str, created: int, choices: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": req.model, "choices": choices}
    if req.include_usage:
        out["usage"] = None
    return out


def completion_chunk(req: TextRequest, rid: str, created: int, index: int, text: str,
                     finish_reason: str | None) -> dict[str, Any]:
    return _chunk(req, "text_completion", rid, created,
                  [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}])


def chat_chunk(req: TextRequest, rid: str, created: int, index: int, delta: dict[str, Any],
               finish_reason: str | None) -> dict[str, Any]:
    return _chunk(req, "chat.completion.chunk", rid, created,
                  [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}])


def usage_chunk(req: TextRequest, rid: str, created: int, completion_tokens: int) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [],
            "usage": usage(req.prompt_tokens, completion_tokens)}


def sse(obj: Any) -> bytes:
    """One Server-Sent Event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
