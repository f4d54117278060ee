"""`trainmesh data prepare`: every input kind, llm.c's shard bytes, the manifest, the split, and the same output
for any number of workers. Its refusals and memory use are in test_prepare_errors.py."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainmesh.core.errors import UserError
from trainmesh.data import encode, textstream
from trainmesh.data import split as split_module
from trainmesh.data.prepare import Prepared, PrepareOptions, prepare
from trainmesh.data.shards import ShardWriter
from trainmesh.data.split import TrainValSplit
from trainmesh.data.tokenizer import get_tokenizer

DOCS = ["First document.\nIt has two lines.", "Second: ünïcode ✓ and  spaces\n\n", "third"]


def read_llmc(path: Path) -> np.ndarray:
    """A shard read from llm.c's layout as its dev/data/data_common.py `write_datafile` writes it: 256 int32
    (magic 20240520, version 1, token count, then zeros), then the tokens as uint16; independent of trainmesh."""
    data = path.read_bytes()
    magic, version, count, *rest = struct.unpack("<256i", data[:1024])
    assert (magic, version) == (20240520, 1) and not any(rest)
    assert len(data) == 1024 + 2 * count
    return np.frombuffer(data[1024:], dtype="<u2")


def run(tmp_path: Path, *inputs: Path, out: str = "out", **options: Any) -> Prepared:
    return prepare(PrepareOptions(inputs=inputs, out=tmp_path / out, progress=False, **options))


def stream(done: Prepared) -> np.ndarray:
    """train then val: the token stream of a corpus shorter than one validation period (its tail is val)."""
    shards = [*done.manifest.train.shards, *done.manifest.val.shards]
    return np.concatenate([read_llmc(done.folder / s.file) for s in shards])


def expected(docs: list[str], tokenizer: str = "gpt2") -> list[int]:
    tok = get_tokenizer(tokenizer)
    ids: list[int] = []
    for doc in docs:
        ids += ([] if tok.eot is None else [tok.eot]) + tok.encode(doc).tolist()
    return ids


def test_shards_are_written_byte_for_byte_as_llmc_writes_them(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello world, " * 100)
    done = run(tmp_path, tmp_path / "a.txt", tokenizer="gpt2", val_fraction=0.1)
    (train,) = done.manifest.train.shards
    assert train.file == "out_train_000000.bin"  # llm.c's names: <name>_<split>_<index:06d>.bin
    data = (done.folder / train.file).read_bytes()
    tokens = read_llmc(done.folder / train.file)
    ints = np.zeros(256, dtype=np.int32)  # what write_datafile builds, for a little-endian machine
    ints[:3] = 20240520, 1, len(tokens)
    assert data == ints.tobytes() + tokens.astype(np.uint16).tobytes()
    assert len(tokens) == train.tokens > 0


def test_text_files_are_one_document_each_after_eot(tmp_path: Path) -> None:
    for i, doc in enumerate(DOCS):
        (tmp_path / f"{i}.txt").write_text(doc)
    done = run(tmp_path, *(tmp_path / f"{i}.txt" for i in range(3)), tokenizer="gpt2", val_fraction=0.2)
    assert stream(done).tolist() == expected(DOCS)
    assert done.manifest.train.documents + done.manifest.val.documents == 3
    byte = run(tmp_path, *(tmp_path / f"{i}.txt" for i in range(3)), out="byte", val_fraction=0.2)
    assert bytes(stream(byte).astype(np.uint8)) == "".join(DOCS).encode()  # no separator without an eot


def test_jsonl_parquet_and_saved_datasets_give_the_same_documents(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset, DatasetDict

    rows = [{"text": d, "id": i} for i, d in enumerate(DOCS)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")  # a blank line is skipped
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet", row_group_size=2)
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    other = Dataset.from_list([{"text": "not this split", "id": 9}])
    DatasetDict({"train": Dataset.from_list(rows), "test": other}).save_to_disk(str(tmp_path / "saved_dict"))
    for name in ("d.jsonl", "d.jsonl.gz", "d.parquet", "saved", "saved_dict"):
        done = run(tmp_path, tmp_path / name, out=f"out-{name}", tokenizer="gpt2", val_fraction=0.2)
        assert stream(done).tolist() == expected(DOCS), name
    assert done.manifest.sources[0].path.endswith("saved_dict/train")  # a DatasetDict's train split


def test_folders_are_walked_in_order_skipping_hidden_and_other_files(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "b" / "deeper").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "a.txt").write_text("A")
    (root / "b" / "deeper" / "c.md").write_text("C")
    (root / "b" / "b.txt").write_text("B")
    (root / "d.csv").write_text("not read")
    (root / ".secret.txt").write_text("not read")
    (root / ".hidden" / "x.txt").write_text("not read")
    (root / "z.txt.gz").write_bytes(gzip.compress(b"Z"))
    (root / "b" / "loop").symlink_to(root, target_is_directory=True)  # must not hang
    done = run(tmp_path, root, val_fraction=0.2)
    names = [Path(s.path).relative_to(root.resolve()).as_posix() for s in done.manifest.sources]
    assert names == ["a.txt", "b/b.txt", "b/deeper/c.md", "z.txt.gz"]
    assert bytes(stream(done).astype(np.uint8)) == b"ABCZ"


def test_a_prepared_folder_inside_an_input_folder_is_skipped_not_read_as_json_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An earlier prepare's output (manifest.json and .bin shards) inside a walked folder: its manifest.json was
    read as JSON Lines and stopped the run with "repair or remove that line"."""
    (tmp_path / "a.txt").write_text("A")
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "b.txt").write_text("B" * 100)
    run(tmp_path, tmp_path / "corpus" / "b.txt", out="corpus/tokens")
    with caplog.at_level("WARNING", logger="trainmesh"):
        done = run(tmp_path, tmp_path / "a.txt", tmp_path / "corpus", out="again", val_fraction=0.2)
    assert [Path(s.path).name for s in done.manifest.sources] == ["a.txt", "b.txt"]
    assert re.search(r"not reading .*corpus/tokens: a folder of prepared token shards", caplog.text)
    with pytest.raises(UserError, match=r"input folder '.*tokens' holds prepared token shards.*--data.source="):
        run(tmp_path, tmp_path / "corpus" / "tokens", out="twice")


def test_the_output_is_the_same_for_any_number_of_workers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Tasks and pieces are cut in this process: made small, there are dozens of tasks in flight in 3 workers,
    so results taken back out of order would show (with the default 1 MiB there were two). Every file of the
    folder, manifest.json included, is the same byte for byte."""
    monkeypatch.setattr(encode, "TASK_CHARS", 20_000)
    monkeypatch.setattr(textstream, "READ_BYTES", 8192)
    monkeypatch.setattr(textstream, "PIECE_CHARS", 10_000)
    monkeypatch.setattr(textstream, "SEARCH_CHARS", 2000)
    monkeypatch.setattr(textstream, "MAX_PIECE_CHARS", 40_000)
    tasks: list[int] = []
    real_tasks = encode._tasks

    def counted(pieces: Any) -> Any:
        for task in real_tasks(pieces):
            tasks.append(len(task.pieces))
            yield task

    monkeypatch.setattr(encode, "_tasks", counted)
    rng = np.random.default_rng(0)
    words = np.array(["the", "data", "tokens", "shard", "\n", "é", "  ", "GPT-2", "2024", "!", "end.\nNext"])
    for i in range(3):  # 3 documents of 0.6 MB, cut into pieces
        (tmp_path / f"{i}.txt").write_text(" ".join(rng.choice(words, 120_000)))
    lines = [json.dumps({"text": " ".join(rng.choice(words, int(n)))}) for n in rng.integers(1, 400, 600)]
    (tmp_path / "short.jsonl").write_text("\n".join(lines))  # 600 documents, many to a task
    inputs = [*(tmp_path / f"{i}.txt" for i in range(3)), tmp_path / "short.jsonl"]
    folders = []
    for w in (1, 3):
        tasks.clear()
        folders.append(run(tmp_path, *inputs, out=f"w{w}/data", tokenizer="gpt2", shard_tokens=50_000, workers=w))
        assert len(tasks) > 48 and max(tasks) > 10, tasks
    one, three = (done.folder for done in folders)
    assert len(folders[0].manifest.train.shards) > 3 and folders[0].manifest.val.tokens > 0
    assert sorted(os.listdir(one)) == sorted(os.listdir(three))
    for name in os.listdir(one):
        assert (one / name).read_bytes() == (three / name).read_bytes(), name


def test_the_manifest_records_what_was_read_and_written(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("some text " * 40_000)
    done = run(tmp_path, tmp_path / "a.txt", tokenizer="gpt2", shard_tokens=20_000, val_fraction=0.25)
    body = json.loads((done.folder / "manifest.json").read_text())
    assert body["format"] == "trainmesh-tokens" and body["format_version"] == 1
    assert body["tokenizer"] == {"name": "gpt2", "vocab_size": 50257, "eot": 50256}
    assert body["options"]["shard_tokens"] == 20_000 and body["trainmesh_version"]
    (source,) = body["sources"]
    raw = (tmp_path / "a.txt").read_bytes()
    assert source["bytes"] == len(raw) and source["sha256"] == hashlib.sha256(raw).hexdigest()
    for split in ("train", "val"):
        shards = body["splits"][split]["shards"]
        assert sum(s["tokens"] for s in shards) == body["splits"][split]["tokens"] > 0
        for shard in shards:
            data = (done.folder / shard["file"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == shard["sha256"]
            assert len(read_llmc(done.folder / shard["file"])) == shard["tokens"] <= 20_000
    assert body["tokens"] == body["splits"]["train"]["tokens"] + body["splits"]["val"]["tokens"]
    assert sorted(os.listdir(done.folder)) == sorted(
        ["manifest.json"] + [s["file"] for p in ("train", "val") for s in body["splits"][p]["shards"]]
    )


def test_the_manifest_and_the_folder_are_on_disk_before_the_folder_is_renamed_into_place(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """'A folder with a manifest is complete' holds across a power loss: every file and the staging folder are
    fsynced before the rename, and the folder holding --out after it."""
    (tmp_path / "a.txt").write_text("some text " * 1000)
    events: list[str] = []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(os, "rename", lambda src, dst: (events.append(f"rename {src} {dst}"), real_rename(src, dst)))
    done = run(tmp_path, tmp_path / "a.txt", workers=1)
    staging = tmp_path / f".out.partial-{os.getpid()}"
    commit = events.index(f"rename {staging} {done.folder}")
    files = [staging / name for name in os.listdir(done.folder)]
    assert len(files) == 3 and set(map(str, [*files, staging])) <= set(events[:commit])
    assert str(tmp_path) in events[commit:]


def test_a_big_text_is_cut_where_gpt2_tokens_do_not_change(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Pieces of a text file, tokenised apart, give the tokens of the whole file (GPT-2's pre-tokeniser never
    joins across a newline between two non-space characters)."""
    monkeypatch.setattr(textstream, "READ_BYTES", 97)
    monkeypatch.setattr(textstream, "PIECE_CHARS", 200)
    monkeypatch.setattr(textstream, "SEARCH_CHARS", 50)
    monkeypatch.setattr(textstream, "MAX_PIECE_CHARS", 800)
    lines = ["def f(x):", "    return x  ", "", "Ünïcödé ✓ text.", "\t tabbed", "x = 1\u3000", "end"]
    text = "\n".join(lines[i % len(lines)] for i in range(700))
    path = tmp_path / "big.txt"
    path.write_text(text)
    tok = get_tokenizer("gpt2")
    with path.open("rb") as f:
        pieces = list(textstream.text_pieces(path, f, f.tell))
    assert len(pieces) > 20 and [p.starts_document for p in pieces[:2]] == [True, False]
    assert "".join(p.text for p in pieces) == text
    assert np.concatenate([tok.encode(p.text) for p in pieces]).tolist() == tok.encode(text).tolist()
    assert sum(p.source_bytes for p in pieces) == len(text.encode())


def test_text_without_a_clean_cut_is_cut_at_a_newline_and_round_trips(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(textstream, "READ_BYTES", 64)
    monkeypatch.setattr(textstream, "PIECE_CHARS", 100)
    monkeypatch.setattr(textstream, "MAX_PIECE_CHARS", 300)
    path = tmp_path / "crlf.txt"
    path.write_bytes(b"line of windows text\r\n" * 200)  # CRLF: no newline between two non-space characters
    with path.open("rb") as f, caplog.at_level("INFO", logger="trainmesh"):
        pieces = list(textstream.text_pieces(path, f, f.tell))
    assert "".join(p.text for p in pieces) == path.read_bytes().decode()
    assert all(p.text.endswith("\n") for p in pieces) and len(pieces) > 5
    assert "cut(s) of its text where the tokens may differ" in caplog.text


@pytest.mark.parametrize(("length", "val"), [(100, [*range(30, 40), *range(70, 80)]), (25, list(range(19, 25)))])
def test_every_kth_block_is_validation_and_a_short_corpus_gives_its_tail(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, length: int, val: list[int]
) -> None:
    monkeypatch.setattr(split_module, "VAL_BLOCK_TOKENS", 10)
    writers = [ShardWriter(tmp_path, "t", s, 1000) for s in ("train", "val")]
    router = TrainValSplit(0.25, *writers)  # every 4th block of 10: blocks 3 and 7
    tokens = np.arange(length, dtype=np.uint16)
    for start in range(0, length, 7):  # fed in pieces that do not line up with the blocks
        chunk = tokens[start : start + 7]
        router.feed(chunk, np.array([i - start for i in (0, 35, 72) if start <= i < start + 7], dtype=np.int64))
    router.finish()
    for w in writers:
        w.close()
    got = {s: read_llmc(tmp_path / f"t_{s}_000000.bin").tolist() for s in ("train", "val")}
    assert got["val"] == val and got["train"] == [t for t in range(length) if t not in val]
    starts = [i for i in (0, 35, 72) if i < length]
    assert router.documents == {"val": sum(i in val for i in starts), "train": sum(i not in val for i in starts)}
