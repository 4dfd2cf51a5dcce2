"""The network: a small decoder-only transformer in numpy (float32), greedy decoding.

Per layer (pre-norm): RMSNorm -> causal multi-head self-attention (one fused
QKV matmul, a KV cache per sequence) -> residual; RMSNorm -> MLP (matmul,
GELU, matmul) -> residual.  Token embeddings plus fixed sinusoidal positions
in; an output matrix (``unembed``) gives the logits over the word tokens.

Every function here is synchronous and CPU-bound; the server runs it on a
thread pool (numpy's matmuls release the GIL).  Nothing writes the weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from numaserve.apps.model.blas import import_numpy
from numaserve.apps.model.shape import BYTE_TOKENS, ModelShape

np = import_numpy()   # before anything else imports it: see blas.py

__all__ = ["Cache", "Network"]


@dataclass
class Cache:
    """One sequence's keys and values per layer (preallocated to its longest length)."""

    keys: list[Any]
    values: list[Any]
    length: int = 0
    capacity: int = field(default=0)


def _rmsnorm(x: Any, w: Any) -> Any:
    return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5)) * w


def _gelu(x: Any) -> Any:
    return 0.5 * x * (1.0 + np.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))


def _positions(ctx: int, d: int) -> Any:
    pos = np.arange(ctx, dtype=np.float32)[:, None]
    rate = np.exp(-math.log(10000.0) * np.arange(0, d, 2, dtype=np.float32) / d)
    out = np.zeros((ctx, d), dtype=np.float32)
    out[:, 0::2] = np.sin(pos * rate)
    out[:, 1::2] = np.cos(pos * rate)[:, : d // 2]
    return out * np.float32(0.5)


class Network:
    """Forward passes over loaded weights (a dict of float32 arrays named as in ``ModelShape``)."""

    def __init__(self, shape: ModelShape, tensors: dict[str, Any]) -> None:
        self.shape = shape
        self.t = tensors
        self.pos = _positions(shape.ctx, shape.d_model)
        self.head_dim = shape.d_model // shape.n_heads

    def new_cache(self, capacity: int) -> Cache:
        capacity = min(capacity, self.shape.ctx)
        d, n = self.shape.d_model, self.shape.n_layers
        return Cache([np.empty((capacity, d), np.float32) for _ in range(n)],
                     [np.empty((capacity, d), np.float32) for _ in range(n)], 0, capacity)

    def hidden(self, tokens: list[int], cache: Cache) -> Any:
        """Run ``tokens`` (after what ``cache`` holds) through every layer; the final-normed states."""
        s, t = self.shape, self.t
        start, T = cache.length, len(tokens)
        if not tokens or start + T > cache.capacity:
            raise ValueError(f"{T} tokens after {start} do not fit a cache of {cache.capacity}")
        x = t["embed"][np.asarray(tokens)] + self.pos[start:start + T]
        H, hd = s.n_heads, self.head_dim
        end = start + T
        mask = np.triu(np.full((T, end), -np.inf, np.float32), k=start + 1) if T > 1 else None
        for i in range(s.n_layers):
            p = f"layers.{i}."
            h = _rmsnorm(x, t[p + "norm1"])
            q, k, v = np.split(h @ t[p + "wqkv"], 3, axis=-1)
            cache.keys[i][start:end] = k
            cache.values[i][start:end] = v
            qh = q.reshape(T, H, hd).transpose(1, 0, 2)                         # H T hd
            kh = cache.keys[i][:end].reshape(end, H, hd).transpose(1, 2, 0)     # H hd end
            vh = cache.values[i][:end].reshape(end, H, hd).transpose(1, 0, 2)   # H end hd
            scores = (qh @ kh) * np.float32(1.0 / math.sqrt(hd))                # H T end
            if mask is not None:
                scores += mask
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            att = (scores @ vh).transpose(1, 0, 2).reshape(T, s.d_model)
            x = x + att @ t[p + "wo"]
            h = _rmsnorm(x, t[p + "norm2"])
            x = x + _gelu(h @ t[p + "w1"]) @ t[p + "w2"]
        cache.length = end
        return _rmsnorm(x, t["norm_f"])

    def next_token(self, tokens: list[int], cache: Cache) -> int:
        """Feed ``tokens``; the greedy (argmax) next word token."""
        h = self.hidden(tokens, cache)[-1]
        logits = h @ self.t["unembed"]
        return BYTE_TOKENS + int(np.argmax(logits))

    def embed(self, tokens: list[int]) -> Any:
        """A unit vector for a text: the mean of its final hidden states."""
        tokens = tokens[-self.shape.ctx:] or [ord(" ")]
        h = self.hidden(tokens, self.new_cache(len(tokens))).mean(axis=0)
        return h / max(float(np.linalg.norm(h)), 1e-6)
