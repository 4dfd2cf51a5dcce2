"""Frame codec: round trips, limits, and fuzzing of the parser (no crash, hang or unbounded memory)."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from numaserve.framing import (
    HEADER,
    MAX_FRAME_LIMIT,
    FrameDecoder,
    FrameError,
    decode_request,
    decode_response,
    encode_frame,
    encode_request,
    encode_response,
    looks_like_http,
)


def test_http_methods_are_sniffed_and_frame_prefixes_are_not() -> None:
    for m in (b"GET", b"POST", b"PUT", b"HEAD", b"DELETE", b"OPTIONS", b"PATCH", b"CONNECT", b"TRACE", b"PRI"):
        assert looks_like_http(m[0])
    for n in (0, 1, 1 << 20, MAX_FRAME_LIMIT):
        assert not looks_like_http(struct.pack(">I", n)[0])
    assert MAX_FRAME_LIMIT < 0x41 << 24  # any "A".."Z" first byte is an impossible length
    assert MAX_FRAME_LIMIT < 0x0A << 24  # so is the LF/CR of an empty line before a request


def test_request_round_trip_msgpack_and_json() -> None:
    for as_json in (False, True):
        p = encode_request(7, "post", "/v1/x?q=1", headers={"Accept": "a/b"}, body=b"hello", timeout=2.5,
                           as_json=as_json)
        assert (p[:1] == b"{") is as_json
        r = decode_request(p)
        assert (r.id, r.method, r.path, r.body, r.timeout, r.json) == (7, "POST", "/v1/x?q=1", b"hello", 2.5, as_json)
        assert r.headers == [(b"accept", b"a/b")]


def test_json_object_body_is_passed_as_json_text() -> None:
    r = decode_request(encode_request("a", "POST", "/e", body={"input": ["x", "y"]}, as_json=True))
    assert r.body == b'{"input":["x","y"]}' and (b"content-type", b"application/json") in r.headers
    r = decode_request(encode_request("a", "POST", "/e", body={"input": 1}))  # msgpack map: JSON-encoded
    assert r.body == b'{"input":1}'
    r = decode_request(encode_request(1, "POST", "/e", body=b"\xff\x00", as_json=True))  # binary → body_b64
    assert r.body == b"\xff\x00"


@pytest.mark.parametrize("payload,fragment", [
    (b"", "empty frame"),
    (b"{", "bad JSON"),
    (b"\xc1", "bad msgpack"),
    (msgspec.json.encode({"id": 3, "method": "G ET"}), "bad method"),
    (msgspec.json.encode({"id": 4, "path": "nope"}), "path must start"),
    (msgspec.json.encode({"id": 5, "headers": {"a\r\n": "b"}}), "bad header"),
    (msgspec.json.encode({"id": 6, "timeout": -1}), "timeout"),
    (msgspec.json.encode({"id": 7, "body_b64": "!!"}), "base64"),
    (msgspec.json.encode([1, 2]), "bad msgpack"),  # not "{": read as msgpack
])
def test_bad_requests_are_400_with_a_reason(payload: bytes, fragment: str) -> None:
    with pytest.raises(FrameError) as ei:
        decode_request(payload)
    assert ei.value.status == 400 and fragment in ei.value.message


def test_error_keeps_the_request_id_when_it_can() -> None:
    with pytest.raises(FrameError) as ei:
        decode_request(msgspec.json.encode({"id": 42, "method": 5}))
    assert ei.value.request_id == 42


def test_response_round_trip_and_binary_body_in_json() -> None:
    for as_json in (False, True):
        p = encode_response(9, 503, [(b"retry-after", b"2")], b"\xffbin", as_json=as_json, error="busy")
        r = decode_response(p)
        assert r["id"] == 9 and r["status"] == 503 and r["body"] == b"\xffbin" and r["error"] == "busy"
        assert r["headers"] == [("retry-after", "2")]


def test_decoder_splits_across_reads_and_reuses_its_buffer() -> None:
    d = FrameDecoder(1024, initial=64)
    stream = b"".join(encode_frame(bytes([i]) * i) for i in range(1, 40))
    out: list[bytes] = []
    for i in range(0, len(stream), 7):  # 7-byte reads: every split point
        out += d.feed(stream[i:i + 7])
    assert out == [bytes([i]) * i for i in range(1, 40)]
    assert d.pending == 0 and d.capacity == 64


def test_decoder_grows_for_a_big_frame_then_shrinks() -> None:
    d = FrameDecoder(100_000, initial=64)
    big = b"x" * 50_000
    assert d.feed(encode_frame(big)[:1000]) == []
    assert d.capacity <= 2 * 1000 + 2 * 64   # grows with what arrived, not to the declared 50 kB
    assert d.feed(encode_frame(big)[1000:]) == [big]
    d.get_buffer()
    assert d.capacity == 64


def test_a_length_prefix_alone_does_not_allocate_the_declared_size() -> None:
    """Issue 34: 100 connections x 5 bytes held +107 MiB (each buffer grown to 1 MiB)."""
    d = FrameDecoder(1 << 20, initial=64 * 1024)
    assert d.feed(HEADER.pack(1 << 20) + b"x") == []
    d.get_buffer()
    assert d.capacity == 64 * 1024
    chunk = b"y" * 100_000
    fed = 5
    while fed < (1 << 20) - 100_000:
        d.feed(chunk)
        fed += len(chunk)
        assert d.capacity <= 2 * fed + 64 * 1024


def test_decoder_refuses_oversized_frames_without_allocating() -> None:
    d = FrameDecoder(1000, initial=64)
    with pytest.raises(FrameError) as ei:
        d.feed(HEADER.pack(0xFFFFFFFF) + b"x")
    assert ei.value.status == 413 and d.capacity == 64


def test_decoder_zero_copy_views() -> None:
    d = FrameDecoder(1000, initial=64)
    buf = d.get_buffer()
    data = encode_frame(b'{"id":1}')
    buf[:len(data)] = data
    d.buffer_updated(len(data))
    (view,) = list(d.frames())
    assert isinstance(view, memoryview) and view.obj is buf.obj  # the same bytearray: not copied
    assert decode_request(view).id == 1


# --- fuzzing -------------------------------------------------------------------------

MAX = 4096


def _drive(data: bytes, chunk: int) -> tuple[list[bytes], FrameDecoder, FrameError | None]:
    d = FrameDecoder(MAX, initial=256)
    out: list[bytes] = []
    try:
        for i in range(0, len(data), chunk):
            out += d.feed(data[i:i + chunk])
            assert d.capacity <= MAX + HEADER.size + chunk  # bounded memory
    except FrameError as e:
        return out, d, e
    return out, d, None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=20_000), st.integers(min_value=1, max_value=5000))
def test_fuzz_random_bytes(data: bytes, chunk: int) -> None:
    frames, d, err = _drive(data, chunk)
    assert err is None or err.status == 413
    for f in frames:
        assert len(f) <= MAX
        try:
            decode_request(f)
        except FrameError as e:
            assert e.status == 400


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=600), max_size=20), st.integers(min_value=0, max_value=4),
       st.integers(min_value=1, max_value=700))
def test_fuzz_truncated_streams(payloads: list[bytes], cut: int, chunk: int) -> None:
    stream = b"".join(encode_frame(p) for p in payloads)
    stream = stream[:max(0, len(stream) - cut)]
    frames, d, err = _drive(stream, chunk)
    assert err is None
    assert frames == payloads[:len(frames)]  # a truncated tail is withheld, never garbled
    if cut == 0:
        assert frames == payloads and d.pending == 0


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=MAX + 1, max_value=0xFFFFFFFF), st.binary(max_size=100))
def test_fuzz_huge_length_prefixes(length: int, rest: bytes) -> None:
    frames, d, err = _drive(HEADER.pack(length) + rest, 4096)
    assert frames == [] and err is not None and err.status == 413
    assert d.capacity <= 256


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**63, max_value=2**63) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(["id", "method", "path", "headers", "body", "body_b64", "timeout", "x"]),
                       _json_values, max_size=7),
       st.booleans())
def test_fuzz_garbage_payloads_give_400_or_a_request(obj: dict, as_json: bool) -> None:
    payload = msgspec.json.encode(obj) if as_json else msgspec.msgpack.encode(obj)
    try:
        r = decode_request(payload)
    except FrameError as e:
        assert e.status == 400 and e.message
    else:
        assert r.path.startswith("/") and isinstance(r.body, bytes) and r.method.isalpha()


def test_deeply_nested_payload_is_a_400_not_a_crash() -> None:
    n = 200_000
    for payload in (b'{"body":' + b"[" * n + b"]" * n + b"}", b"\x81\xa4body" + b"\x91" * n + b"\x90"):
        with pytest.raises(FrameError) as ei:
            decode_request(payload)
        assert ei.value.status == 400
