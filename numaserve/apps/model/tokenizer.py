"""A self-contained tokenizer: 256 byte tokens plus a word list derived from the model's seed.

Why this one: nothing to download, every text encodes (unknown words fall
back to their UTF-8 bytes) and decoding an encoding gives the text back
exactly.  Word tokens carry their leading space (``" node"``), like GPT-2's
BPE, so a generated sequence of words reads as text.  The model generates
word tokens only, so streamed output is always whole, valid UTF-8.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from numaserve.apps.model.shape import BYTE_TOKENS

__all__ = ["Tokenizer", "word_list"]

_COMMON = (
    "the of and to in is that it for on with as was at by be this from or an are not have "
    "node socket memory core cache thread worker queue latency token model batch kernel page "
    "local remote bind policy affinity interrupt listener accept drain ready heartbeat stats "
    "supervisor slot generation request response stream tensor weight layer attention vector"
).split()
_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl sh st th tr".split()
_VOWELS = "a e i o u ai ea io ou".split()
_PIECE = re.compile(r"\s*\S+|\s+")


def word_list(seed: int, count: int) -> list[str]:
    """``count`` distinct lower-case words: common English first, then seeded syllable words."""
    words = list(dict.fromkeys(_COMMON))[:count]
    seen = set(words)
    rng = random.Random(seed)
    while len(words) < count:
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 3)))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


class Tokenizer:
    """Text <-> token ids for a model with ``words`` word tokens made from ``seed``."""

    def __init__(self, seed: int, words: int) -> None:
        self.words = word_list(seed, words)
        self._pieces: list[bytes] = [bytes([b]) for b in range(BYTE_TOKENS)]
        self._pieces += [(" " + w).encode() for w in self.words]
        self._ids = {(" " + w): BYTE_TOKENS + i for i, w in enumerate(self.words)}

    @property
    def vocab(self) -> int:
        return len(self._pieces)

    def encode(self, text: str) -> list[int]:
        """Whitespace-led pieces: a known word is one token, anything else its UTF-8 bytes."""
        out: list[int] = []
        for piece in _PIECE.findall(text):
            tid = self._ids.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(piece.encode("utf-8", "surrogatepass"))
        return out

    def piece(self, token: int) -> bytes:
        return self._pieces[token]

    def decode(self, tokens: Sequence[int]) -> str:
        return b"".join(self._pieces[t] for t in tokens).decode("utf-8", "surrogatepass")
