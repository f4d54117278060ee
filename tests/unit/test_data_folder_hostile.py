"""A prepared data folder from someone else: what its manifest may name, and shards changed behind its back."""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from trainmesh.config import ConfigError
from trainmesh.data import manifest as manifest_module
from trainmesh.data.corpus import BadShardError, check_token_range, shard_corpus
from trainmesh.data.manifest import MANIFEST, Manifest, SplitInfo, TokenizerInfo
from trainmesh.data.shards import ShardWriter
from trainmesh.job.spec import check_data, load_config
from trainmesh.recipes.gpt import recipe as recipe_module


def _prepared(folder: Path, train: list[int], val: list[int], prefix: str = "d") -> Manifest:
    """A prepared folder as `trainmesh data prepare` writes it (byte tokenizer): one shard per split."""
    folder.mkdir(parents=True, exist_ok=True)
    splits = {}
    for split, tokens in (("train", train), ("val", val)):
        writer = ShardWriter(folder, prefix, split, shard_tokens=len(tokens))
        writer.write(np.array(tokens, dtype=np.uint16))
        splits[split] = SplitInfo(1, len(tokens), tuple(writer.close()))
    manifest = Manifest(TokenizerInfo("byte", 256, None), splits["train"], splits["val"], (), {}, "0")
    (folder / MANIFEST).write_text(manifest.to_json())
    return manifest


def _rename_train_shard(folder: Path, name: str) -> None:
    """Make the manifest list `name` as its train shard (the count and SHA-256 left as they are)."""
    text = (folder / MANIFEST).read_text().replace('"d_train_000000.bin"', f'"{name}"')
    (folder / MANIFEST).write_text(text)


def _rewrite_keeping_mtime(path: Path, data: bytes) -> None:
    """Other content of the same size, its modification time put back (as `cp -p` or `rsync -t` leave it)."""
    before = path.stat()
    while path.stat().st_ctime_ns == before.st_ctime_ns:  # a later tick of the file system's clock
        time.sleep(0.005)
        path.write_bytes(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns


@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink"])
def test_a_manifest_cannot_name_a_shard_outside_its_folder(tmp_path: Path, where: str) -> None:
    _prepared(tmp_path / "elsewhere", list(range(50)), [1, 2])  # valid shards, counts and hashes
    outside = tmp_path / "elsewhere" / "d_train_000000.bin"
    data = tmp_path / "data"
    _prepared(data, list(range(50)), [1, 2])
    name = {"dotdot": "../elsewhere/d_train_000000.bin", "absolute": str(outside), "symlink": "d_train_000000.bin"}
    if where == "symlink":
        (data / "d_train_000000.bin").unlink()
        (data / "d_train_000000.bin").symlink_to(outside)
    else:
        _rename_train_shard(data, name[where])
    refused = re.escape(f"lists token shard {name[where]!r}, which is not a file inside")
    with pytest.raises(BadShardError, match=refused):
        shard_corpus(data)


def test_a_symlink_within_the_folder_is_read_but_a_shard_listed_twice_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    _prepared(data, list(range(50)), [1, 2])
    (data / "d_train_000000.bin").rename(data / "real.bin")
    (data / "d_train_000000.bin").symlink_to("real.bin")
    assert [p.name for p in shard_corpus(data).train] == ["d_train_000000.bin"]
    _prepared(data / "v", list(range(50)), list(range(50)))  # val the same content as train, listed as train
    text = (data / "v" / MANIFEST).read_text().replace('"d_val_000000.bin"', '"d_train_000000.bin"')
    (data / "v" / MANIFEST).write_text(text)
    with pytest.raises(BadShardError, match=r"lists token shard .*d_train_000000.bin twice"):
        shard_corpus(data / "v")


def test_a_shard_rewritten_with_its_old_mtime_is_scanned_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shards from elsewhere (no manifest): a rewrite that keeps size and mtime still has its ids checked."""
    monkeypatch.setattr("trainmesh.data.corpus.RACY_NS", 0)  # cache even a file written just now
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(10, dtype=np.uint16).tofile(tmp_path / "val.bin")
    corpus = shard_corpus(tmp_path)
    check_token_range(corpus, 256, tmp_path / "cache")
    _rewrite_keeping_mtime(tmp_path / "train.bin", np.full(100, 300, dtype=np.uint16).tobytes())
    with pytest.raises(BadShardError, match=r"train.bin holds token id 300, outside the model's vocabulary of 256"):
        check_token_range(corpus, 256, tmp_path / "cache")


def test_a_prepared_shard_rewritten_with_its_old_mtime_is_refused_by_its_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("trainmesh.data.corpus.RACY_NS", 0)
    _prepared(tmp_path, list(range(100)), [1, 2])
    shard = tmp_path / "d_train_000000.bin"
    corpus = shard_corpus(tmp_path)
    check_token_range(corpus, 256, tmp_path / "cache")
    header = shard.read_bytes()[:1024]  # the same count: the header agrees with the manifest
    _rewrite_keeping_mtime(shard, header + np.full(100, 300, dtype="<u2").tobytes())
    shard_corpus(tmp_path)  # the cheap check cannot tell
    with pytest.raises(BadShardError, match=r"d_train_000000.bin has SHA-256 [0-9a-f]{64}, but .*manifest.json says"):
        check_token_range(corpus, 256, tmp_path / "cache")


def test_a_valid_shard_of_another_length_swapped_in_is_refused(tmp_path: Path) -> None:
    _prepared(tmp_path / "data", list(range(100)), [1, 2])
    _prepared(tmp_path / "other", list(range(60)), [1, 2])
    (tmp_path / "other" / "d_train_000000.bin").replace(tmp_path / "data" / "d_train_000000.bin")
    with pytest.raises(BadShardError, match=r"d_train_000000.bin holds 60 tokens, but .*manifest.json says 100 tokens"):
        shard_corpus(tmp_path / "data")


NOT_READ = "is not a manifest this trainmesh reads .*: "


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda text: text.replace('"tokens": 100,', '"tokens": "100",'), f"{NOT_READ}shard entry .* is not"),
        (lambda text: text.replace('"vocab_size": 256', '"vocab_size": "256"'), f"{NOT_READ}tokenizer .* is not"),
        (lambda text: "[]", f"{NOT_READ}'list' object has no attribute 'get'"),
        (lambda text: "[" * 100_000 + "]" * 100_000, "holds JSON nested too deeply to read"),
    ],
    ids=["count", "vocabulary", "a list", "deep"],
)
def test_a_manifest_of_the_wrong_shape_is_refused_in_one_line(
    tmp_path: Path, edit: Callable[[str], str], message: str
) -> None:
    _prepared(tmp_path, list(range(100)), [1, 2])
    (tmp_path / MANIFEST).write_text(edit((tmp_path / MANIFEST).read_text()))
    with pytest.raises(BadShardError, match=r"manifest.json " + message + r".*\. Fix: prepare the folder again"):
        shard_corpus(tmp_path)


def test_check_fails_a_folder_that_cannot_train_with_the_message_training_gives(tmp_path: Path) -> None:
    _prepared(tmp_path / "data", list(range(100)), [1, 2])
    config = load_config(None, [f"--data.source={tmp_path / 'data'}"], "gpt")
    check_data(config)  # whole: fine
    with (tmp_path / "data" / "d_train_000000.bin").open("r+b") as f:
        f.truncate(1024 + 2 * 99)  # a partial copy
    with pytest.raises(BadShardError) as training:
        shard_corpus(tmp_path / "data")
    with pytest.raises(ConfigError) as check:
        check_data(config)
    assert str(check.value) == str(training.value)
    assert "d_train_000000.bin has 1,222 bytes, but its llm.c header says 100 tokens" in str(check.value)


def test_a_shard_name_with_a_nul_byte_is_refused_naming_the_manifest(tmp_path: Path) -> None:
    """It was a bare `ValueError: embedded null byte` from resolving the path."""
    _prepared(tmp_path, list(range(50)), [1, 2])
    _rename_train_shard(tmp_path, "d_train\\u0000_000000.bin")
    message = re.escape(
        f"{tmp_path / MANIFEST} lists token shard 'd_train\\x00_000000.bin', which is not a file inside"
    )
    with pytest.raises(BadShardError, match=message + r".*a NUL byte"):
        shard_corpus(tmp_path)


@pytest.mark.parametrize("planted", ["a FIFO", "too large"])
def test_a_manifest_is_read_only_as_a_regular_file_of_bounded_size(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, planted: str
) -> None:
    """A FIFO named manifest.json was taken for no manifest (the shards then read by their names), and a manifest was
    read whole whatever its size."""
    _prepared(tmp_path, list(range(50)), [1, 2])
    if planted == "a FIFO":
        (tmp_path / MANIFEST).unlink()
        os.mkfifo(tmp_path / MANIFEST)
        why = "is not a regular file"
    else:
        monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", 100)
        why = "is larger than 100 bytes"
    with pytest.raises(BadShardError, match=re.escape(f"{tmp_path / MANIFEST} {why}. Fix: prepare the folder again")):
        shard_corpus(tmp_path)


def test_check_turns_an_unreadable_data_folder_into_the_configs_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """check_data runs in every launcher: a PermissionError from the folder was a traceback."""
    _prepared(tmp_path / "data", list(range(100)), [1, 2])
    config = load_config(None, [f"--data.source={tmp_path / 'data'}"], "gpt")
    shard = tmp_path / "data" / "d_train_000000.bin"

    def unreadable(folder: Path) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(shard))

    monkeypatch.setattr(recipe_module, "shard_corpus", unreadable)  # as root, chmod 000 would not stop a read
    with pytest.raises(ConfigError, match=re.escape(f"cannot read {shard} (Permission denied). Fix: make it readable")):
        check_data(config)
