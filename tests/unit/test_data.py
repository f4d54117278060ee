from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from support import nano_config, train_records
from trainmesh.data.corpus import (
    BadShardError,
    check_token_range,
    embedded_files,
    load_tokens,
    shard_corpus,
    text_corpus,
)
from trainmesh.data.datasets import TokenWindows
from trainmesh.data.tokenizer import ByteTokenizer, get_tokenizer
from trainmesh.worker import run_worker


def test_byte_tokenizer_round_trips_unicode() -> None:
    tok = ByteTokenizer()
    text = "déf f(x): return x ** 2  # ✓"
    assert tok.decode(tok.encode(text).tolist()) == text
    with pytest.raises(ValueError, match="data.tokenizer='bpe' is unknown"):
        get_tokenizer("bpe")


def test_embedded_corpus_is_real_python_within_the_cap() -> None:
    files = embedded_files(300_000)
    assert files and sum(f.stat().st_size for f in files) <= 300_000
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    assert files == embedded_files(300_000)  # a fixed order


def test_text_corpus_is_cached_and_split(tmp_path: Path) -> None:
    source = tmp_path / "book.txt"
    source.write_text("abcdefghij" * 20_000)  # 200 kB -> several 64 KiB chunks
    corpus = text_corpus([source], ByteTokenizer(), 0.25, tmp_path / "cache")
    train = np.fromfile(corpus.train[0], dtype=np.uint16)
    val = np.fromfile(corpus.val[0], dtype=np.uint16)
    assert len(train) + len(val) == 200_000 and len(val) > 0 and corpus.vocab_size == 256
    again = text_corpus([source], ByteTokenizer(), 0.25, tmp_path / "cache")
    assert again == corpus  # served from the cache
    assert len(list((tmp_path / "cache").iterdir())) == 1  # no leftover staging folders


def test_token_windows_are_shifted_pairs_across_shards(tmp_path: Path) -> None:
    np.arange(0, 25, dtype=np.uint16).tofile(tmp_path / "train_0.bin")
    np.save(tmp_path / "train_1.npy", np.arange(100, 111, dtype=np.uint16))
    np.arange(0, 9, dtype=np.uint16).tofile(tmp_path / "val_0.bin")
    corpus = shard_corpus(tmp_path)
    assert corpus.vocab_size == 0  # unknown for shards: the config must say
    ds = TokenWindows(corpus.train, block_size=4)
    assert len(ds) == 6 + 2
    x, y = ds[1]
    assert torch.equal(x, torch.tensor([4, 5, 6, 7])) and torch.equal(y, torch.tensor([5, 6, 7, 8]))
    x, _ = ds[7]
    assert torch.equal(x, torch.tensor([104, 105, 106, 107]))
    with pytest.raises(IndexError):
        ds[8]


def test_shard_folder_needs_both_splits(tmp_path: Path) -> None:
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "train_0.bin")
    with pytest.raises(ValueError, match=r"needs \*train\*.bin\|.npy and \*val\*"):
        shard_corpus(tmp_path)


def test_bad_shards_are_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    np.save(tmp_path / "floats.npy", np.ones(4, dtype=np.float32))
    (tmp_path / "pickled.npy").write_bytes(b"not an array")
    for name, message in [
        ("empty.bin", "empty.bin is empty (0 bytes)"),
        ("odd.bin", "odd.bin has 3 bytes, not a whole number of 2-byte (uint16) token ids"),
        ("floats.npy", "floats.npy holds a float32 array"),
        ("pickled.npy", "pickled.npy is not a readable .npy array"),
    ]:
        with pytest.raises(BadShardError, match=re.escape(message)):
            load_tokens(tmp_path / name)


def test_token_ids_beyond_the_vocabulary_are_caught_once_at_the_start(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    np.array([1, 2, 3, 50256, 4], dtype=np.uint16).tofile(data / "train_0.bin")
    np.arange(10, dtype=np.uint16).tofile(data / "val_0.bin")
    corpus = shard_corpus(data)
    with pytest.raises(BadShardError, match=r"train_0.bin holds token id 50256, outside .* of 50000.*vocab_size=50257"):
        check_token_range(corpus, 50_000, tmp_path / "cache")
    check_token_range(corpus, 50_304, tmp_path / "cache")  # fits
    np.save(data / "val_0.npy", np.array([3, -1, 2], dtype=np.int16))
    (data / "val_0.bin").unlink()
    with pytest.raises(BadShardError, match=r"val_0.npy holds a negative token id \(-1\)"):
        check_token_range(shard_corpus(data), 50_304, tmp_path / "cache")


def test_text_that_is_not_utf8_is_trained_on_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source = tmp_path / "latin1.txt"
    source.write_bytes(("déjà vu " * 2000).encode("latin-1"))
    with caplog.at_level(logging.WARNING, logger="trainmesh"):
        corpus = text_corpus([source], ByteTokenizer(), 0.25, tmp_path / "cache")
    assert "latin1.txt is not valid UTF-8 (first at byte 1 of 16000" in caplog.text
    assert corpus.train and corpus.val


def test_loader_worker_processes_feed_the_same_batches(tmp_path: Path) -> None:
    """data.num_workers > 0 (what GPU configs use, so loading overlaps the step) trains on the same samples in
    the same order as loading in the training process: the same losses, step for step."""
    for workers in (0, 2):
        config = nano_config(tmp_path, f"--data.num_workers={workers}", f"--run.id=w{workers}")
        run_worker(config, tmp_path / "runs" / f"w{workers}")
    losses = [[r["loss"] for r in train_records(tmp_path / "runs" / f"w{w}")] for w in (0, 2)]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
