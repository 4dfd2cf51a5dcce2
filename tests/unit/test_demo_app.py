"""The embedded demo app, called directly through ASGI (no server)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from numaserve.apps import demo
from numaserve.apps.demo import MAX_TOKENS_LIMIT, MODEL_ID, app


def call(method: str, path: str, body: bytes = b"", chunks: list[bytes] | None = None
         ) -> tuple[int, dict[bytes, bytes], bytes]:
    """Run one request through the app; returns (status, headers, body)."""
    parts = chunks if chunks is not None else [body]
    incoming: list[dict[str, Any]] = [
        {"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop(0)
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}
    asyncio.run(app(scope, receive, send))
    start = sent[0]
    assert start["type"] == "http.response.start"
    out = b"".join(m.get("body", b"") for m in sent[1:])
    headers = dict(start["headers"])
    if b"content-length" in headers:
        assert int(headers[b"content-length"]) == len(out)
    return start["status"], headers, out


def post_json(obj: Any) -> tuple[int, dict[str, Any]]:
    status, _, body = call("POST", "/v1/completions", json.dumps(obj).encode())
    return status, json.loads(body)


def test_healthz() -> None:
    status, headers, body = call("GET", "/healthz")
    assert (status, body) == (200, b"ok")


def test_models_list_shape() -> None:
    status, headers, body = call("GET", "/v1/models")
    data = json.loads(body)
    assert status == 200 and headers[b"content-type"] == b"application/json"
    assert data["object"] == "list"
    assert data["data"][0]["id"] == MODEL_ID and data["data"][0]["object"] == "model"


def test_whoami_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NUMASERVE_SLOT", "3")
    monkeypatch.setenv("NUMASERVE_NODE", "1")
    monkeypatch.setenv("NUMASERVE_GENERATION", "7")
    monkeypatch.setenv("NUMASERVE_CPUS", "4-6,9")
    monkeypatch.setenv("NUMASERVE_MEMPOLICY", "bind=static:1")
    status, _, body = call("GET", "/")
    data = json.loads(body)
    assert status == 200
    assert data["slot"] == 3 and data["node"] == 1 and data["generation"] == 7
    assert data["cpus"] == [4, 5, 6, 9] and data["mempolicy"] == "bind=static:1"
    assert data["pid"] > 0 and data["hostname"]


def test_whoami_falls_back_to_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in ("NUMASERVE_SLOT", "NUMASERVE_NODE", "NUMASERVE_GENERATION", "NUMASERVE_CPUS",
                 "NUMASERVE_MEMPOLICY"):
        monkeypatch.delenv(name, raising=False)
    data = json.loads(call("GET", "/")[2])
    assert data["cpus"] == sorted(os.sched_getaffinity(0))
    assert data["slot"] is None and data["mempolicy"] is None


def test_completion_shape_and_usage() -> None:
    status, data = post_json({"model": "m1", "prompt": "the quick brown fox", "max_tokens": 5,
                              "temperature": 0.7})
    assert status == 200
    assert data["object"] == "text_completion" and data["model"] == "m1"
    assert data["id"].startswith("cmpl-") and isinstance(data["created"], int)
    (choice,) = data["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert len(choice["text"].split()) == 5 and choice["text"].startswith(" ")
    assert data["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}


def test_completion_is_deterministic_per_prompt() -> None:
    a = post_json({"prompt": "alpha", "max_tokens": 12})[1]["choices"][0]["text"]
    b = post_json({"prompt": "alpha", "max_tokens": 12})[1]["choices"][0]["text"]
    c = post_json({"prompt": "beta", "max_tokens": 12})[1]["choices"][0]["text"]
    assert a == b and a != c
    # a longer completion extends the shorter one
    longer = post_json({"prompt": "alpha", "max_tokens": 20})[1]["choices"][0]["text"]
    assert longer.startswith(a)


def test_default_max_tokens_and_model() -> None:
    status, data = post_json({"prompt": "x"})
    assert status == 200 and data["usage"]["completion_tokens"] == 16 and data["model"] == MODEL_ID


def test_list_prompt_gives_one_choice_each() -> None:
    status, data = post_json({"prompt": ["a b", "c"], "max_tokens": 3})
    assert status == 200
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}


def test_chunked_body_is_assembled() -> None:
    raw = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    status, _, body = call("POST", "/v1/completions", chunks=[raw[:5], raw[5:], b""])
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("max_tokens", [0, -1, MAX_TOKENS_LIMIT + 1, "8", 1.5, True])
def test_max_tokens_out_of_range_is_400(max_tokens: Any) -> None:
    status, data = post_json({"prompt": "x", "max_tokens": max_tokens})
    assert status == 400
    assert data["error"]["type"] == "invalid_request_error" and data["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("body", [{"prompt": 5}, {"prompt": []}, {"prompt": ["a", 1]},
                                  {"prompt": ["x"] * 17}, [1, 2], {"model": ""},
                                  {"prompt": "x", "stream": "yes"},
                                  {"prompt": "x", "stream_options": {"include_usage": True}},
                                  {"prompt": "x", "n": 0}, {"prompt": ["a", "b"], "n": 9},
                                  {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, {"prompt": "x", "stop": 5}])
def test_bad_parameters_are_400(body: Any) -> None:
    status, data = post_json(body)
    assert status == 400 and set(data["error"]) == {"message", "type", "param", "code"}


def test_bad_json_is_400_openai_shape() -> None:
    status, headers, body = call("POST", "/v1/completions", b"{not json")
    data = json.loads(body)
    assert status == 400 and headers[b"content-type"] == b"application/json"
    assert data["error"]["type"] == "invalid_request_error" and "JSON" in data["error"]["message"]
    status, _, _ = call("POST", "/v1/completions", b"\xff\xfe")
    assert status == 400


@pytest.mark.parametrize("raw", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000,
                                 b"\xff\xfe", b"[1,", b'{"model": "x"', b""],
                         ids=["nested-arrays", "nested-objects", "not-utf8", "truncated", "unclosed", "empty"])
def test_any_invalid_json_is_400_openai_shape(raw: bytes) -> None:
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        status, _headers, body = call("POST", path, raw)
        assert status == 400, (path, raw[:20], body[:200])
        err = json.loads(body)["error"]
        assert err["type"] == "invalid_request_error" and err["message"].startswith("invalid JSON body")


def test_wrong_method_is_405_with_allow() -> None:
    status, headers, body = call("GET", "/v1/completions")
    assert status == 405 and headers[b"allow"] == b"POST" and "error" in json.loads(body)
    status, headers, _ = call("DELETE", "/healthz")
    assert status == 405 and headers[b"allow"] == b"GET, HEAD"


def test_unknown_path_is_404_json() -> None:
    status, headers, body = call("GET", "/v2/whatever")
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error"


def test_oversized_body_is_413(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo, "MAX_REQUEST_BYTES", 10)
    status, _, body = call("POST", "/v1/completions", chunks=[b"x" * 8, b"x" * 8])
    assert status == 413 and "error" in json.loads(body)


def test_client_gone_mid_body_sends_nothing() -> None:
    sent: list[Any] = []
    msgs = [{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return msgs.pop(0)

    async def send(m: Any) -> None:
        sent.append(m)

    asyncio.run(app({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []},
                    receive, send))
    assert sent == []


def test_cost_is_proportional_to_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = demo._mix

    def counting(state: int, rounds: int) -> int:
        calls.append(rounds)
        return real(state, rounds)

    monkeypatch.setattr(demo, "_mix", counting)
    post_json({"prompt": ["a", "b"], "max_tokens": 40})
    assert calls == [demo.ROUNDS_PER_TOKEN] * 80
    assert demo.measure_token_cost(tokens=5) > 0


def test_generation_yields_to_the_loop() -> None:
    ticks = 0

    async def main() -> None:
        nonlocal ticks

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        await demo.generate("p", 64, rounds=10)
        t.cancel()

    asyncio.run(main())
    assert ticks >= 64 // demo.YIELD_EVERY


def test_lifespan_startup_and_shutdown() -> None:
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(m: Any) -> None:
        sent.append(m)

    asyncio.run(app({"type": "lifespan"}, receive, send))
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


# --- OpenAI chat completions and streaming -------------------------------------------------


def post(path: str, obj: Any) -> tuple[int, dict[bytes, bytes], bytes]:
    return call("POST", path, json.dumps(obj).encode())


def sse_events(body: bytes) -> list[Any]:
    """The data of each Server-Sent Event; "[DONE]" stays a string."""
    assert body.endswith(b"\n\n")
    out = []
    for block in body.decode().split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


CHAT = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                   {"role": "user", "content": [{"type": "text", "text": "hello there"}]}]}


def test_chat_completion_shape_and_usage() -> None:
    status, _, body = post("/v1/chat/completions", {**CHAT, "max_tokens": 6})
    data = json.loads(body)
    assert status == 200 and data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
    (choice,) = data["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    content = choice["message"]["content"]
    assert len(content.split()) == 6 and not content.startswith(" ")
    assert data["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}
    # max_completion_tokens wins over max_tokens, as in the OpenAI API
    data = json.loads(post("/v1/chat/completions", {**CHAT, "max_tokens": 6, "max_completion_tokens": 3})[2])
    assert data["usage"]["completion_tokens"] == 3 and data["choices"][0]["message"]["content"] == " ".join(
        content.split()[:3])


def test_chat_stream_is_openai_chunks_then_done() -> None:
    status, headers, body = post("/v1/chat/completions", {**CHAT, "max_tokens": 8, "stream": True})
    assert status == 200 and headers[b"content-type"].startswith(b"text/event-stream")
    events = sse_events(body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pieces = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert len(pieces) == 8  # one chunk per token
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    plain = json.loads(post("/v1/chat/completions", {**CHAT, "max_tokens": 8})[2])
    assert "".join(pieces) == plain["choices"][0]["message"]["content"]


def test_stream_usage_in_the_last_chunk_when_asked() -> None:
    _, _, body = post("/v1/completions", {"prompt": "a b c", "max_tokens": 4, "stream": True,
                                          "stream_options": {"include_usage": True}})
    chunks = sse_events(body)[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == post_json({"prompt": "a b c", "max_tokens": 4})[1]["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_n_choices_and_stop_words() -> None:
    one = post_json({"prompt": "seed", "max_tokens": 30})[1]["choices"][0]["text"]
    status, data = post_json({"prompt": "seed", "max_tokens": 30, "n": 3})
    assert status == 200 and [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert data["choices"][0]["text"] == one and data["choices"][1]["text"] != one
    assert data["usage"]["completion_tokens"] == 90
    words = one.split()
    stop_word = words[5]
    first = words.index(stop_word)
    data = post_json({"prompt": "seed", "max_tokens": 30, "stop": [stop_word]})[1]
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"].split() == words[:first]
    assert data["usage"]["completion_tokens"] == first


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"), ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**CHAT, "n": 17}, "n"),
])
def test_bad_chat_requests_are_400_naming_the_param(body: Any, param: str) -> None:
    status, _, raw = post("/v1/chat/completions", body)
    err = json.loads(raw)["error"]
    assert status == 400 and err["param"] == param and err["type"] == "invalid_request_error"


def test_model_by_id() -> None:
    status, _, body = call("GET", f"/v1/models/{MODEL_ID}")
    assert status == 200 and json.loads(body)["id"] == MODEL_ID
    status, _, body = call("GET", "/v1/models/gpt-17")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


def test_stream_stops_generating_when_the_client_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0
    real = demo._mix

    def counting(state: int, rounds: int) -> int:
        nonlocal calls
        calls += 1
        return real(state, rounds)

    monkeypatch.setattr(demo, "_mix", counting)
    sent: list[Any] = []
    raw = json.dumps({"prompt": "x", "max_tokens": 4000, "stream": True}).encode()

    async def main() -> None:
        body_given = False

        async def receive() -> dict[str, Any]:
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": raw, "more_body": False}
            while len(sent) < 20:  # the client reads a few tokens, then goes away
                await asyncio.sleep(0)
            return {"type": "http.disconnect"}

        async def send(m: Any) -> None:
            sent.append(m)

        await app({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive, send)

    asyncio.run(main())
    assert 20 <= calls < 100 and sent[-1].get("more_body") is True  # stopped, no [DONE] for nobody
