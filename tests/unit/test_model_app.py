"""The reference model app (numaserve.apps.model): weights file, loader errors, network, tokenizer, ASGI app."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("safetensors")
np = pytest.importorskip("numpy")

from numaserve.apps.model import engine, server  # noqa: E402
from numaserve.apps.model.network import Network  # noqa: E402
from numaserve.apps.model.shape import ModelShape, SizeError, parse_size, shape_for_size  # noqa: E402
from numaserve.apps.model.tokenizer import Tokenizer, word_list  # noqa: E402
from numaserve.apps.model.weights import WeightsError, init_weights, load_weights  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TINY = ModelShape(d_model=64, n_layers=2, n_heads=4, d_ff=256, words=500, ctx=128)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny.safetensors"
    init_weights(str(path), TINY, seed=7)
    return path


@pytest.fixture(scope="module")
def net(weights_file: Path) -> tuple[Network, Tokenizer]:
    w = load_weights(str(weights_file))
    return Network(w.shape, w.tensors), Tokenizer(w.seed, w.shape.words)


# --- sizes and the file --------------------------------------------------------------------


def test_parse_size_units_and_errors() -> None:
    assert parse_size("32MB") == 32_000_000 and parse_size("1GiB") == 1 << 30 and parse_size("2 gb") == 2 * 10**9
    assert parse_size("4096") == 4096
    for bad in ("", "2XB", "-1GB", "GB"):
        with pytest.raises(SizeError, match="expected a number"):
            parse_size(bad)


def test_shape_for_size_fits_the_budget_and_refuses_too_small() -> None:
    for size in (32 * 10**6, 10**9):
        s = shape_for_size(size)
        assert s.nbytes() <= size and s.d_model % 64 == 0 and s.d_model % s.n_heads == 0
        assert s.nbytes() > size * 0.6  # the widest that fits, not something much smaller
    with pytest.raises(SizeError, match="too small"):
        shape_for_size(1000)


def test_init_is_deterministic_per_seed(tmp_path: Path, weights_file: Path) -> None:
    again, other = tmp_path / "again.safetensors", tmp_path / "other.safetensors"
    init_weights(str(again), TINY, seed=7)
    init_weights(str(other), TINY, seed=8)
    assert sha(again) == sha(weights_file) and sha(other) != sha(weights_file)
    assert not [p for p in os.listdir(tmp_path) if ".part-" in p]  # no temporary file left behind


def test_file_is_plain_safetensors(weights_file: Path) -> None:
    from safetensors.numpy import load_file

    tensors = load_file(str(weights_file))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == dict(TINY.tensors())
    assert all(v.dtype == np.float32 for v in tensors.values())


def test_loaded_tensors_are_owned_read_only_copies(weights_file: Path) -> None:
    w = load_weights(str(weights_file))
    assert w.shape == TINY and w.seed == 7 and w.nbytes == TINY.nbytes()
    t = w.tensors["layers.0.wqkv"]
    assert not t.flags.writeable
    maps = Path("/proc/self/maps").read_text()
    assert str(weights_file) not in maps  # not the file's page cache: the process's own memory


# --- what a bad file says -------------------------------------------------------------------


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8:8 + n])


def _rewrite_header(src: Path, dst: Path, edit: Any) -> None:
    """A copy of ``src`` whose JSON header went through ``edit`` (re-padded; data unchanged)."""
    raw = src.read_bytes()
    n, header = _header(src)
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    dst.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _flip_byte(src: Path, dst: Path) -> None:
    raw = bytearray(src.read_bytes())
    n, header = _header(src)
    start = 8 + n + header["layers.1.w1"]["data_offsets"][0] + 100
    raw[start] ^= 0x40
    dst.write_bytes(bytes(raw))


def _wrong_dtype(src: Path, dst: Path) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(src))
    _, header = _header(src)
    tensors["layers.0.wo"] = tensors["layers.0.wo"].astype(np.float16)
    save_file(tensors, str(dst), metadata=header["__metadata__"])


def _wrong_shape(h: dict[str, Any]) -> None:
    a, b = h["norm_f"]["data_offsets"]
    h["norm_f"]["shape"] = [(b - a) // 8, 2]


CASES = {
    "missing": (lambda src, dst: None, "no such file"),
    "truncated": (lambda src, dst: dst.write_bytes(src.read_bytes()[:-1000]), "not a valid safetensors file"),
    "bad header": (lambda src, dst: dst.write_bytes(b"\xff" * 8 + src.read_bytes()[8:]),
                   "not a valid safetensors file"),
    "header not JSON": (lambda src, dst: dst.write_bytes(src.read_bytes()[:8] + b"#" + src.read_bytes()[9:]),
                        "not a valid safetensors file"),
    "not ours": (lambda src, dst: _rewrite_header(src, dst, lambda h: h["__metadata__"].pop("format")),
                 "not a numaserve model"),
    "bad metadata": (lambda src, dst: _rewrite_header(src, dst, lambda h: h["__metadata__"].update(d_model="x")),
                     "metadata 'd_model' is 'x'"),
    "wrong dtype": (_wrong_dtype, "tensor 'layers.0.wo' has dtype F16, expected F32"),
    "wrong shape": (lambda src, dst: _rewrite_header(src, dst, _wrong_shape),
                    "tensor 'norm_f' has shape [32, 2], expected [64]"),
    "no checksums": (lambda src, dst: _rewrite_header(src, dst, lambda h: h["__metadata__"].pop("crc32")),
                     "metadata crc32 is missing"),
    "corrupt data": (_flip_byte, "tensor 'layers.1.w1' fails its checksum"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_weight_file_is_one_line_naming_file_and_fault(case: str, weights_file: Path, tmp_path: Path) -> None:
    make, expect = CASES[case]
    dst = tmp_path / "bad.safetensors"
    make(weights_file, dst)
    with pytest.raises(WeightsError) as e:
        load_weights(str(dst))
    msg = str(e.value)
    assert msg.startswith(f"model weights {dst}: ") and expect in msg and "\n" not in msg, msg


def test_missing_tensor_is_named(weights_file: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(weights_file))
    _, header = _header(weights_file)
    del tensors["layers.1.norm2"]
    save_file(tensors, str(tmp_path / "m.safetensors"), metadata=header["__metadata__"])
    with pytest.raises(WeightsError, match=r"tensor 'layers.1.norm2' is missing"):
        load_weights(str(tmp_path / "m.safetensors"))


# --- tokenizer and network ---------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "the node", "  two  spaces\tand tabs\n", "héllo wörld 🚀 memory", "x" * 300,
                                  "user: hi\nassistant: the slot"])
def test_tokenizer_round_trip(text: str) -> None:
    tok = Tokenizer(3, 500)
    ids = tok.encode(text)
    assert tok.decode(ids) == text and all(0 <= i < tok.vocab for i in ids)


def test_known_words_are_one_token_and_word_list_is_seeded() -> None:
    tok = Tokenizer(3, 500)
    assert tok.encode(" node memory") == [tok.encode(" node")[0], tok.encode(" memory")[0]]
    assert word_list(3, 500) == word_list(3, 500) != word_list(4, 500)
    assert len(set(word_list(3, 500))) == 500


def test_greedy_decoding_is_deterministic_and_the_cache_is_exact(net: tuple[Network, Tokenizer]) -> None:
    n, tok = net
    prompt = tok.encode("user: which node serves this?")

    def generate(k: int) -> list[int]:
        cache = n.new_cache(len(prompt) + k)
        out = [n.next_token(prompt, cache)]
        while len(out) < k:
            out.append(n.next_token([out[-1]], cache))
        return out

    out = generate(12)
    assert out == generate(12) and all(256 <= t < tok.vocab for t in out)
    # one token at a time through the KV cache == the whole sequence at once
    full = n.hidden(prompt + out[:-1], n.new_cache(len(prompt) + 12))
    assert int(np.argmax(full[-1] @ n.t["unembed"])) + 256 == out[-1]
    step = n.new_cache(len(prompt) + 12)
    n.hidden(prompt, step)
    for t in out[:-1]:
        last = n.hidden([t], step)
    np.testing.assert_allclose(last[-1], full[-1], rtol=1e-4, atol=1e-4)


def test_forward_shapes_and_embedding(net: tuple[Network, Tokenizer]) -> None:
    n, tok = net
    ids = tok.encode("the memory of a node")
    assert n.hidden(ids, n.new_cache(len(ids))).shape == (len(ids), TINY.d_model)
    e = n.embed(ids)
    assert e.shape == (TINY.d_model,) and abs(float(np.linalg.norm(e)) - 1.0) < 1e-4
    assert n.embed([]).shape == (TINY.d_model,)
    with pytest.raises(ValueError, match="do not fit"):
        n.hidden(ids, n.new_cache(2))


# --- the app through ASGI ----------------------------------------------------------------------


@pytest.fixture
def loaded(weights_file: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(engine.MODEL_ENV, str(weights_file))
    monkeypatch.setattr(engine, "_model", None)
    engine.load()
    yield


def call(method: str, path: str, body: Any = None) -> tuple[int, bytes]:
    raw = b"" if body is None else json.dumps(body).encode()
    incoming = [{"type": "http.request", "body": raw, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop(0)
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b""}
    asyncio.run(server.app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def sse_events(body: bytes) -> list[Any]:
    out = []
    for line in body.decode().split("\n\n"):
        if line.startswith("data: "):
            out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def test_chat_stream_is_openai_chunks_matching_the_unstreamed_reply(loaded: None) -> None:
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    status, body = call("POST", "/v1/chat/completions", ask | {"stream": True,
                                                               "stream_options": {"include_usage": True}})
    assert status == 200
    events = sse_events(body)
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pieces = [e["choices"][0]["delta"].get("content") for e in events[1:-2] if e["choices"][0]["delta"]]
    assert len(pieces) == 10 and events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 10 and events[-2]["choices"] == []
    status, body = call("POST", "/v1/chat/completions", ask)
    reply = json.loads(body)
    assert status == 200 and reply["choices"][0]["message"]["content"] == "".join(pieces)
    assert reply["model"] == "tiny" and not reply["choices"][0]["message"]["content"].startswith(" ")


def test_completions_n_choices_differ_and_stop_cuts(loaded: None) -> None:
    status, body = call("POST", "/v1/completions", {"prompt": "the node", "max_tokens": 8, "n": 2})
    r = json.loads(body)
    texts = [c["text"] for c in r["choices"]]
    assert status == 200 and len(texts) == 2 and texts[0] != texts[1] and texts[0].startswith(" ")
    assert r["usage"]["completion_tokens"] == 16
    stop = texts[0].split()[2]
    status, body = call("POST", "/v1/completions", {"prompt": "the node", "max_tokens": 8, "stop": stop})
    c = json.loads(body)["choices"][0]
    assert c["finish_reason"] == "stop" and c["text"] == texts[0][:texts[0].index(stop)]


def test_embeddings_models_and_errors(loaded: None) -> None:
    status, body = call("POST", "/v1/embeddings", {"input": ["a node", "memory"]})
    r = json.loads(body)
    assert status == 200 and [len(d["embedding"]) for d in r["data"]] == [TINY.d_model] * 2
    assert json.loads(call("GET", "/v1/models")[1])["data"][0]["id"] == "tiny"
    assert call("GET", "/v1/models/tiny")[0] == 200 and call("GET", "/v1/models/other")[0] == 404
    assert call("POST", "/v1/embeddings", {"input": 3})[0] == 400
    assert call("GET", "/v1/completions")[0] == 405
    status, body = call("POST", "/v1/completions", {"prompt": "x", "max_tokens": TINY.ctx})
    assert status == 400 and json.loads(body)["error"]["param"] == "max_tokens"


def test_load_without_the_variable_says_which(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(engine.MODEL_ENV, raising=False)
    monkeypatch.setattr(engine, "_model", None)
    with pytest.raises(WeightsError, match="NUMASERVE_MODEL is not set"):
        engine.load()


def test_lifespan_reports_a_bad_file_as_startup_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(engine.MODEL_ENV, str(tmp_path / "nope.safetensors"))
    monkeypatch.setattr(engine, "_model", None)
    sent: list[dict[str, Any]] = []
    messages = [{"type": "lifespan.startup"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(m: dict[str, Any]) -> None:
        sent.append(m)

    asyncio.run(server.app({"type": "lifespan"}, receive, send))
    assert sent[0]["type"] == "lifespan.startup.failed" and "nope.safetensors: no such file" in sent[0]["message"]
    assert not engine.loaded()


def test_importing_the_app_leaves_a_template_single_threaded(weights_file: Path) -> None:
    """OpenBLAS starts its pool when numpy is imported; a template with threads cannot fork."""
    code = ("import os, numaserve.apps.model as m; m.load(); "
            "print(len(os.listdir('/proc/self/task')), os.environ['OPENBLAS_NUM_THREADS'])")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "4", "OMP_NUM_THREADS": "4", engine.MODEL_ENV: str(weights_file),
           "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=str(REPO))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["1", "4"]  # one thread, and the slot's setting is back for the worker


def test_cli_init_and_check(tmp_path: Path, weights_file: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "numaserve", "model", *args], capture_output=True, text=True,
                              timeout=120, cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)})

    path = tmp_path / "m.safetensors"
    r = cli("init", str(path), "--size", "8MB", "--seed", "1", "--words", "1000", "--layers", "2")
    assert r.returncode == 0 and "d_model" in r.stdout, r.stderr
    assert cli("check", str(path)).returncode == 0
    r = cli("init", str(path), "--size", "8MB")
    assert r.returncode == 2 and r.stderr.strip() == f"numaserve: error: {path} exists (use --force to replace it)"
    r = cli("init", str(tmp_path / "x"), "--size", "lots")
    assert r.returncode == 2 and "--size" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    _flip_byte(weights_file, tmp_path / "bad.safetensors")
    r = cli("check", str(tmp_path / "bad.safetensors"))
    assert r.returncode == 1 and "fails its checksum" in r.stderr and len(r.stderr.strip().splitlines()) == 1
