"""The reference model's shape: sizes from a byte budget, tensor names and shapes (pure).

Why a module of its own: ``numaserve model init`` (writer), the loader and the
network must agree on one list of tensors; a file whose header differs from
this list is refused by name instead of failing somewhere in a matmul.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

__all__ = ["FORMAT", "BYTE_TOKENS", "ModelShape", "SizeError", "parse_size", "shape_for_size"]

#: ``__metadata__["format"]`` of a weights file this package writes and reads.
FORMAT = "numaserve-model/1"
#: Token ids 0..255 are the raw bytes (any text encodes); word tokens follow.
BYTE_TOKENS = 256
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
          "g": 10**9, "gb": 10**9, "gib": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


class SizeError(ValueError):
    """A size or shape an operator gave that cannot be used; ``str()`` is one line."""


def parse_size(text: str) -> int:
    """``"2GB"`` / ``"32MiB"`` / ``"1e6"``-free plain numbers -> bytes (decimal GB, binary GiB)."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS:
        raise SizeError(f"size {text!r}: expected a number with an optional unit (e.g. 32MB, 2GB, 1GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class ModelShape:
    """Hyper-parameters of the transformer; stored as strings in the file's metadata."""

    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    words: int          # word tokens after the 256 byte tokens
    ctx: int            # longest sequence (prompt + generated)

    @property
    def vocab(self) -> int:
        return BYTE_TOKENS + self.words

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor in file order: (name, shape); all float32."""
        d, f = self.d_model, self.d_ff
        out: list[tuple[str, tuple[int, ...]]] = [("embed", (self.vocab, d))]
        for i in range(self.n_layers):
            p = f"layers.{i}."
            out += [(p + "norm1", (d,)), (p + "wqkv", (d, 3 * d)), (p + "wo", (d, d)),
                    (p + "norm2", (d,)), (p + "w1", (d, f)), (p + "w2", (f, d))]
        out += [("norm_f", (d,)), ("unembed", (d, self.words))]
        return out

    def nbytes(self) -> int:
        return sum(4 * math.prod(s) for _, s in self.tensors())

    def to_metadata(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> "ModelShape":
        """Raises SizeError naming the first missing or bad key."""
        values: dict[str, int] = {}
        for name in cls.__dataclass_fields__:
            raw = meta.get(name)
            if raw is None or not raw.isdigit() or int(raw) <= 0:
                raise SizeError(f"metadata {name!r} is {raw!r}, expected a positive integer")
            values[name] = int(raw)
        shape = cls(**values)
        if shape.d_model % shape.n_heads:
            raise SizeError(f"metadata d_model {shape.d_model} is not a multiple of n_heads {shape.n_heads}")
        return shape


def shape_for_size(size: int, *, layers: int = 8, heads: int = 8, words: int = 8000, ctx: int = 1024) -> ModelShape:
    """The widest model (d_model a multiple of 64, d_ff = 4 d_model) whose weights fit in ``size`` bytes."""
    if layers < 1 or heads < 1 or words < 1 or ctx < 8:
        raise SizeError("layers, heads and words must be >= 1 and ctx >= 8")
    step = 64 * heads // math.gcd(64, heads)  # d_model divisible by 64 and by the head count
    params = size // 4
    # params = 12 L d^2 + (vocab + words + 2 L + 1) d   (embed in, unembed out)
    a, b = 12 * layers, BYTE_TOKENS + 2 * words + 2 * layers + 1
    d = int((-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)) // step * step
    if d < step:
        smallest = ModelShape(step, layers, heads, 4 * step, words, ctx).nbytes()
        raise SizeError(f"size {size} bytes is too small for {layers} layers and {words} words "
                        f"(at least {smallest} bytes)")
    return ModelShape(d, layers, heads, 4 * d, words, ctx)
