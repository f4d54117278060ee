from __future__ import annotations

import logging
import os
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

import trainmesh.data.corpus as corpus_module
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
from trainmesh.job.worker import run_worker


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
    # the choice and order the corpus's cache key was made with: the .py files by path, these folders left out
    root, skip = Path(sysconfig.get_paths()["stdlib"]), {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    chosen, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if not skip & set(path.relative_to(root).parts[:-1]) and total + path.stat().st_size <= 300_000:
            chosen.append(path)
            total += path.stat().st_size
    assert files == chosen


def test_text_corpus_is_cached_and_split(tmp_path: Path) -> None:
    source = tmp_path / "book.txt"
    source.write_text("abcdefghij" * 20_000)  # 200 kB -> several 64 KiB chunks
    corpus = text_corpus([source], ByteTokenizer(), 0.25, tmp_path / "cache")
    train, val = load_tokens(corpus.train[0]), load_tokens(corpus.val[0])  # llm.c's header, then the tokens
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


def test_a_shard_is_read_whole_once_and_again_only_when_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    np.arange(100, dtype=np.uint16).tofile(data / "train.bin")
    np.arange(10, dtype=np.uint16).tofile(data / "val.bin")
    corpus = shard_corpus(data)
    scans: list[str] = []
    real_scan = corpus_module._scan
    monkeypatch.setattr(corpus_module, "_scan", lambda path, sha: scans.append(path.name) or real_scan(path, sha))
    check_token_range(corpus, 256, cache)
    check_token_range(corpus, 256, cache)
    assert sorted(scans) == ["train.bin", "train.bin", "val.bin", "val.bin"]  # written just now: not trusted yet
    monkeypatch.setattr(corpus_module, "RACY_NS", 0)
    scans.clear()
    check_token_range(corpus, 256, cache)
    check_token_range(corpus, 256, cache)
    assert sorted(scans) == ["train.bin", "val.bin"]  # then from the cache
    os.utime(data / "val.bin")  # touched: read again
    check_token_range(corpus, 256, cache)
    assert sorted(scans) == ["train.bin", "val.bin", "val.bin"]


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


def _llmc_shard(path: Path, tokens: list[int], version: int = 1, count: int | None = None) -> None:
    """A shard as llm.c's write_datafile writes it: 256 int32 (magic, version, count, zeros), uint16 tokens."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = 20240520, version, len(tokens) if count is None else count
    path.write_bytes(header.tobytes() + np.array(tokens, dtype="<u2").tobytes())


def test_llmc_shards_are_read_after_their_header_and_raw_shards_still_are(tmp_path: Path) -> None:
    _llmc_shard(tmp_path / "fineweb_train_000001.bin", list(range(100, 125)))
    np.arange(0, 9, dtype=np.uint16).tofile(tmp_path / "val.bin")  # nanoGPT's raw uint16
    corpus = shard_corpus(tmp_path)
    assert load_tokens(corpus.train[0]).tolist() == list(range(100, 125))
    assert load_tokens(corpus.val[0]).tolist() == list(range(9))
    x, y = TokenWindows(corpus.train, block_size=4)[1]
    assert torch.equal(x, torch.tensor([104, 105, 106, 107])) and torch.equal(y, torch.tensor([105, 106, 107, 108]))


def test_damaged_llmc_headers_are_refused_naming_the_file(tmp_path: Path) -> None:
    _llmc_shard(tmp_path / "v7.bin", [1, 2, 3], version=7)
    _llmc_shard(tmp_path / "short.bin", [1, 2, 3], count=4)  # a truncated copy
    (tmp_path / "stub.bin").write_bytes(np.array([20240520, 1], dtype="<i4").tobytes())
    for name, message in [
        ("v7.bin", "v7.bin is an llm.c shard of version 7; trainmesh reads version 1"),
        ("short.bin", "short.bin has 1,030 bytes, but its llm.c header says 4 tokens, which take 1,032 bytes"),
        ("stub.bin", "stub.bin starts with llm.c's magic 20240520 but has 8 bytes, less than its 1024-byte header"),
    ]:
        with pytest.raises(BadShardError, match=re.escape(message)):
            load_tokens(tmp_path / name)


def test_llmc_llama3_shards_are_refused_not_read_as_uint16_tokens(tmp_path: Path) -> None:
    """llm.c's Llama-3 layout (dev/data/data_common.py HEADERS_INFO["llama-3"]: magic 20240801, version 7,
    uint32 tokens) would otherwise pass for raw uint16 tokens: header ints and each id's two halves."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = 20240801, 7, 3
    (tmp_path / "edu_train_000001.bin").write_bytes(header.tobytes() + np.array([128000, 9, 70000], "<u4").tobytes())
    np.arange(0, 9, dtype=np.uint16).tofile(tmp_path / "edu_val_000000.bin")
    message = "edu_train_000001.bin is an llm.c Llama-3 shard (magic 20240801, version 7): uint32 tokens, not supported"
    with pytest.raises(BadShardError, match=re.escape(message) + r".*Fix: .*trainmesh data prepare"):
        load_tokens(tmp_path / "edu_train_000001.bin")
    with pytest.raises(BadShardError, match=re.escape(message)):
        TokenWindows(shard_corpus(tmp_path).train, block_size=4)


def test_a_prepared_folder_is_read_from_its_manifest(tmp_path: Path) -> None:
    from trainmesh.data.prepare import PrepareOptions, prepare

    (tmp_path / "a.txt").write_text("text to train on " * 500)
    out = tmp_path / "pretrain"  # 'train' in every name: the manifest, not the names, tells the splits apart
    prepare(PrepareOptions((tmp_path / "a.txt",), out, shard_tokens=2000, progress=False))
    corpus = shard_corpus(out)
    assert [p.name for p in corpus.train] == [f"pretrain_train_{i:06d}.bin" for i in range(5)]  # 8,075 tokens
    assert [p.name for p in corpus.val] == ["pretrain_val_000000.bin"] and corpus.vocab_size == 256
    with (out / "pretrain_train_000001.bin").open("r+b") as f:
        f.write(b"\0")  # the magic damaged: without the manifest it would pass for raw tokens
    with pytest.raises(
        BadShardError, match=r"pretrain_train_000001.bin holds no llm.c header, but .*manifest.json says"
    ):
        shard_corpus(out)
    (out / "pretrain_train_000001.bin").unlink()
    with pytest.raises(BadShardError, match=r"pretrain_train_000001.bin, which .*manifest.json lists, is missing"):
        shard_corpus(out)


def test_the_gpt_recipe_takes_the_vocabulary_from_the_manifest_and_refuses_another_tokenizer(tmp_path: Path) -> None:
    from trainmesh.config import ConfigError
    from trainmesh.data.prepare import PrepareOptions, prepare
    from trainmesh.job.spec import load_config

    (tmp_path / "a.txt").write_text("text to train on " * 500)
    prepare(PrepareOptions((tmp_path / "a.txt",), tmp_path / "data", tokenizer="gpt2", progress=False))
    source = f"--data.source={tmp_path / 'data'}"
    assert load_config(None, [source, "--data.tokenizer=gpt2"], "gpt").model.vocab_size == 50257
    assert (
        load_config(None, [source, "--data.tokenizer=gpt2", "--model.vocab_size=50304"], "gpt").model.vocab_size
        == 50304
    )
    with pytest.raises(
        ConfigError, match=r"was tokenised with 'gpt2' \(its manifest.json\), but data.tokenizer='byte'"
    ):
        load_config(None, [source], "gpt")
    (tmp_path / "data" / "manifest.json").unlink()
    with pytest.raises(ConfigError, match=r"shards without a manifest.json, so the vocabulary size is unknown"):
        load_config(None, [source], "gpt")
