"""Tokenizers are pluggable: anything with `name`, `vocab_size`, `encode` and `decode`, registered with
`register_tokenizer` and chosen with `data.tokenizer=name`; byte-level is the default.

Details: docs/internals.md#datatokenizerpy
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from trainmesh.data.gpt2 import GPT2Tokenizer


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot: int | None
    """The id that separates documents (GPT-2's <|endoftext|>); None: the tokenizer has none."""

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens. Every text round-trips; a random model's loss starts near ln 256 ≈ 5.55."""

    name = "byte"
    vocab_size = 256
    eot: int | None = None

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


_TOKENIZERS: dict[str, Callable[[], Tokenizer]] = {"byte": ByteTokenizer, "gpt2": GPT2Tokenizer}


def register_tokenizer(name: str, factory: Callable[[], Tokenizer]) -> None:
    _TOKENIZERS[name] = factory


def tokenizer_names() -> list[str]:
    return sorted(_TOKENIZERS)


def get_tokenizer(name: str) -> Tokenizer:
    if name not in _TOKENIZERS:
        known = ", ".join(sorted(_TOKENIZERS))
        raise ValueError(f"data.tokenizer={name!r} is unknown; registered: {known}. Fix: --data.tokenizer=byte")
    return _TOKENIZERS[name]()
