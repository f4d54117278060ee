"""Hostile and damaged inputs to `trainmesh data prepare` (issue 25): each ends in one line naming the file and
the fix, never a traceback, a MemoryError or a segfault, and leaves no staging folder behind."""

from __future__ import annotations

import errno
import gzip
import json
import logging
import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainmesh.core.errors import UserError
from trainmesh.data import prepare as prepare_module
from trainmesh.data import sources
from trainmesh.data.prepare import PrepareOptions, prepare
from trainmesh.data.shards import HEADER_BYTES, ShardWriter
from trainmesh.data.sources import Source, SourceError, read_pieces

SRC = Path(__file__).resolve().parents[2] / "src"


def run(tmp_path: Path, *inputs: Path, out: str = "out", **options: Any) -> bytes:
    """Prepare with the byte tokenizer in this process; the token stream as bytes (train then val: a corpus
    shorter than one validation period)."""
    done = prepare(PrepareOptions(inputs, tmp_path / out, workers=1, progress=False, **options))
    shards = [*done.manifest.train.shards, *done.manifest.val.shards]
    return b"".join((done.folder / s.file).read_bytes()[HEADER_BYTES:] for s in shards)


def refused(message: str, tmp_path: Path, *inputs: Path) -> None:
    left = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(UserError, match=message):
        run(tmp_path, *inputs)
    assert sorted(p.name for p in tmp_path.iterdir()) == left  # no --out, no staging folder


def test_a_json_lines_record_over_the_limit_is_refused_without_being_read_whole(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A 3 MB .jsonl.gz holding one 3 GiB line ended in a MemoryError: lines are read with a bound. Here 20 MB
    of one line against a limit of 1 MiB: refused, naming file:line, having held at most about the limit."""
    monkeypatch.setattr(sources, "MAX_RECORD_BYTES", 1 << 20)
    path = tmp_path / "big.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "fine"}\n{"text": "' + b"a" * (20 << 20) + b'"}\n', compresslevel=1))
    message = r"big.jsonl.gz:2: a JSON Lines record longer than 1,048,576 bytes.*Fix: split that document"
    tracemalloc.start()
    try:
        with pytest.raises(SourceError, match=message):
            list(read_pieces(Source(path, "jsonl", ".gz"), "text"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak
    refused(message, tmp_path, path)


@pytest.mark.parametrize("line", ["[" * 100_000, '{"text": ' + "[" * 100_000, '{"a": ' * 100_000])
def test_deeply_nested_json_is_refused_naming_the_line(tmp_path: Path, line: str) -> None:
    """It was a RecursionError with a traceback: in a JSON Lines file, and in a manifest.json of an input folder
    (looked at to skip an earlier prepare's output) or of --out."""
    (tmp_path / "deep.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    refused(r"deep.jsonl:2: JSON nested more deeply than Python's parser reads.*Fix: repair or remove", tmp_path,
            tmp_path / "deep.jsonl")  # fmt: skip
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text("some text")
    (folder / "manifest.json").write_text(line)  # not an earlier prepare's: read as JSON Lines, refused as such
    refused(r"in/manifest.json:1: JSON nested more deeply", tmp_path, folder)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "manifest.json").write_text(line)
    with pytest.raises(UserError, match=r"--out='.*out' is not the output of an earlier trainmesh data prepare"):
        run(tmp_path, folder / "a.txt", force=True)


def test_a_lone_surrogate_becomes_the_replacement_character_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A JSON string's "\\ud800" decodes to a str that UTF-8 cannot encode: the tokenizer failed with a
    traceback. It becomes U+FFFD, as undecodable bytes in a text file do; a proper pair stays the emoji."""
    records = ['{"text": "a\\ud800b"}', '{"text": "\\ud83d\\ude00"}', '{"text": "c\\udfffd"}']
    (tmp_path / "cut.jsonl").write_text("\n".join(records) + "\n")
    with caplog.at_level(logging.WARNING, logger="trainmesh"):
        tokens = run(tmp_path, tmp_path / "cut.jsonl", val_fraction=0.2)
    assert np.frombuffer(tokens, dtype="<u2").astype(np.uint8).tobytes() == "a\ufffdb😀c\ufffdd".encode()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "cut.jsonl:1: 'text' holds a lone UTF-16 surrogate" in warnings[0], warnings


def _saved_dataset(folder: Path) -> Path:
    """A saved dataset of two documents, and the bytes of its text column's offsets in its Arrow file."""
    from datasets import Dataset

    Dataset.from_list([{"text": "hello world"}, {"text": "second doc"}]).save_to_disk(str(folder))
    return folder / "data-00000-of-00001.arrow"


def _set_offsets(arrow: Path, *offsets: int) -> None:
    data = arrow.read_bytes()
    good = struct.pack("<3i", 0, 11, 21)  # the text column's offsets: 0, len("hello world"), + len("second doc")
    assert data.count(good) == 1
    arrow.write_bytes(data.replace(good, struct.pack("<3i", *offsets)))


def test_a_saved_dataset_with_a_negative_arrow_offset_or_a_file_outside_it_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A negative offset was a raw traceback (SystemError from pyarrow); the Arrow files are validated first, once
    the dataset is found: before every input is hashed."""
    arrow = _saved_dataset(tmp_path / "saved")

    def hashed(*args: Any) -> None:
        raise AssertionError("the inputs were hashed before the saved dataset was checked")

    monkeypatch.setattr(prepare_module, "_describe_sources", hashed)
    _set_offsets(arrow, 0, -5, 21)
    refused(
        r"input .*saved: its Arrow file data-00000-of-00001.arrow is damaged \(record batch 0: .*non-monotonic "
        r"offset.*Fix: save the dataset again",
        tmp_path,
        tmp_path / "saved",
    )
    state = json.loads((tmp_path / "saved" / "state.json").read_text())
    state["_data_files"] = [{"filename": "../elsewhere.arrow"}]
    (tmp_path / "saved" / "state.json").write_text(json.dumps(state))
    refused(r"state.json lists '../elsewhere.arrow', which is not the name of a file in", tmp_path, tmp_path / "saved")


@pytest.mark.parametrize(
    ("splits", "shown"),
    [
        ([5], r"\[5\]"),
        (["../../etc"], r"\['../../etc'\]"),
        (["a\0b"], r"\['a\\x00b'\]"),
        ([], r"\[\]"),
        ("train", "train"),
    ],
)
def test_a_dataset_dict_lists_only_the_names_of_folders_beside_it(tmp_path: Path, splits: Any, shown: str) -> None:
    """[5] was a TypeError's traceback, [] an IndexError's, and "../../etc" read a folder outside the dataset."""
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": splits}))
    refused(
        rf"dd/dataset_dict.json: its \"splits\" is {shown}, not a list of the names of folders beside it. Fix: save",
        tmp_path,
        tmp_path / "dd",
    )


def test_a_saved_dataset_with_an_arrow_offset_out_of_range_is_refused_not_a_segfault(tmp_path: Path) -> None:
    """It segfaulted (exit 139, no message, the staging folder left): run as the CLI, in a process of its own."""
    arrow = _saved_dataset(tmp_path / "saved")
    _set_offsets(arrow, 0, 100_000_000, 21)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "trainmesh.cli", "data", "prepare", "saved", "--out", "out", "--workers", "1"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Offset invariant failure: offset for slot 1 out of bounds" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]


def test_a_parquet_string_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    """It was a UnicodeDecodeError's traceback: Parquet's batches are validated in full as they are read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    pq.write_table(
        pa.table({"text": ["hello world"]}), good, compression="none", use_dictionary=False, write_statistics=False
    )
    data = good.read_bytes()
    assert data.count(b"hello world") == 1
    (tmp_path / "bad.parquet").write_bytes(data.replace(b"hello world", b"hello\xed\xa0\x80rld"))  # a surrogate
    good.unlink()
    refused(
        r"input .*bad.parquet is damaged in the rows from 0 on \(.*Invalid UTF8.*\); nothing is written. Fix: write",
        tmp_path,
        tmp_path / "bad.parquet",
    )


@pytest.mark.parametrize("at", ["a shard", "the manifest"])
def test_a_full_disk_is_one_line_naming_where_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, at: str
) -> None:
    """ENOSPC was a traceback; --force's earlier output stays as it was."""
    (tmp_path / "a.txt").write_text("some text\n" * 100)
    run(tmp_path, tmp_path / "a.txt")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(*((ShardWriter, "write") if at == "a shard" else (prepare_module, "write_atomically")), full)
    with pytest.raises(
        UserError,
        match=r"--out='.*out': the disk holding '.*' is full \(No space left on device; [\d,]+ bytes free there now\) "
        r".*nothing was written to --out. Fix: free space there",
    ):
        run(tmp_path, tmp_path / "a.txt", force=True, val_fraction=0.1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "out"]  # no staging folder
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before


@pytest.mark.parametrize("filename", [None, "/dev/shm/sem.mp-x"])
def test_a_full_disk_elsewhere_is_not_blamed_on_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, filename: str | None
) -> None:
    """Any ENOSPC was reported as --out's disk full: one from elsewhere (the workers' semaphores in /dev/shm, whose
    error names no path) names its path, or says it has none."""
    (tmp_path / "a.txt").write_text("some text\n" * 100)

    def full(*args: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(prepare_module, "encode_pieces", full)
    where, fix = (
        ("'/dev/shm/sem.mp-x'", "free space there")
        if filename
        else (r"a path the error does not name \(most likely /dev/shm, .*\)", r"free space in /dev/shm, or --workers=1")
    )
    message = rf"^a disk is full \(No space left on device\) at {where}, not while prepare wrote to --out; .*Fix: {fix}"
    refused(message, tmp_path, tmp_path / "a.txt")


def test_an_out_that_cannot_be_created_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """It was a traceback (FileExistsError, PermissionError, ...) from making --out's folder; a full disk there
    said to pick a folder one may write to."""
    (tmp_path / "a.txt").write_text("some text\n" * 10)
    with pytest.raises(UserError, match=r"--out='.*a.txt/sub/out': cannot create the folder '.*a.txt/sub' \("):
        run(tmp_path, tmp_path / "a.txt", out="a.txt/sub/out")
    real = Path.mkdir

    def full(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.name == "sub":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", full)
    with pytest.raises(UserError, match=r"'.*/sub' \(No space left on device\). Fix: free space on that disk, or an"):
        run(tmp_path, tmp_path / "a.txt", out="sub/out")


def test_folders_left_moved_aside_by_a_killed_force_are_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A --force killed between moving the old --out aside and putting the new one in place leaves it there, and
    nothing said so: the next prepare names it (and leaves it: it may be the only copy of the old data)."""
    (tmp_path / "a.txt").write_text("some text\n" * 100)
    left = tmp_path / ".out.old-12345"
    left.mkdir()
    with caplog.at_level(logging.WARNING, logger="trainmesh"):
        run(tmp_path, tmp_path / "a.txt")
    assert f"{left} is a folder moved aside while {tmp_path / 'out'} was replaced, and left there" in caplog.text
    assert left.is_dir()


@pytest.mark.parametrize("planted", ["a FIFO", "a symlink to /dev/zero", "a folder"])
def test_a_manifest_that_is_no_regular_file_is_never_read(tmp_path: Path, planted: str) -> None:
    """--force read --out's manifest.json whole to see whose folder it is: a FIFO hung prepare forever, a symlink
    to /dev/zero ended in a MemoryError. Neither is a manifest prepare wrote, so the folder is not replaced."""
    (tmp_path / "a.txt").write_text("some text\n" * 100)
    manifest = tmp_path / "out" / "manifest.json"
    manifest.parent.mkdir()
    if planted == "a FIFO":
        os.mkfifo(manifest)
    elif planted == "a folder":
        manifest.mkdir()
    else:
        manifest.symlink_to("/dev/zero")
    with pytest.raises(UserError, match=r"--out='.*out' is not the output of an earlier trainmesh data prepare"):
        run(tmp_path, tmp_path / "a.txt", force=True)
