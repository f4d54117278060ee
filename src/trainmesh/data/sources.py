"""What `trainmesh data prepare` reads: input paths (files and folders of text, JSON Lines, Parquet, saved datasets)
turned into sources, and sources into documents.

Details: docs/internals.md#datasourcespy
"""

from __future__ import annotations

import bz2
import gzip
import importlib
import importlib.util
import json
import lzma
import os
import re
import sys
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

from trainmesh.core.errors import UserError
from trainmesh.core.files import JsonFileError, is_plain_name, read_json
from trainmesh.core.logging import get_logger
from trainmesh.data.arrowfiles import check_saved_dataset, validated
from trainmesh.data.manifest import MANIFEST, prepared_files
from trainmesh.data.textstream import Piece, text_pieces

log = get_logger(__name__)

TEXT_SUFFIXES = (".txt", ".text", ".md", ".markdown", ".rst")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIX = ".parquet"
OPENERS: dict[str, Any] = {".gz": gzip.GzipFile, ".bz2": bz2.BZ2File, ".xz": lzma.LZMAFile}
NOT_READ = (".zst", ".zstd", ".lz4", ".7z", ".zip", ".tar")
INSTALL_DATA = "pip install 'trainmesh[data]'"
ROWS_PER_BATCH = 1024
MAX_RECORD_BYTES = 64 << 20
"""The longest JSON Lines line (its line end included) read as a record: a record is held whole, and its text
several times over while it is decoded and tokenised (a 512 MiB line took 3.3 GB). Text files stream, any size."""
MAX_JSON_BYTES = 16 << 20  # dataset_dict.json: a list of split names
_SURROGATE = re.compile("[\ud800-\udfff]")  # in a str from json.loads, only ever a lone one: a pair is decoded


class SourceError(UserError, ValueError):
    """An input that cannot be read as documents."""


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str
    """text | jsonl | parquet | hf"""
    compression: str = ""
    """.gz | .bz2 | .xz | "" (text and jsonl only)"""

    def files(self) -> list[Path]:
        """The files whose bytes make up this source (a saved dataset's folder holds several)."""
        if self.kind != "hf":
            return [self.path]
        return sorted(p for p in self.path.rglob("*") if p.is_file() and not p.name.startswith("."))


def find_sources(inputs: Sequence[Path]) -> list[Source]:
    """The sources the inputs name, in order; refuses missing inputs, unreadable kinds and duplicates."""
    sources: list[Source] = []
    skipped: Counter[str] = Counter()
    for given in inputs:
        if not given.exists():
            raise SourceError(f"input {str(given)!r} does not exist. Fix: name existing files or folders.")
        if given.is_dir():
            if prepared_files(given) is not None:
                raise SourceError(
                    f"input folder {str(given)!r} holds prepared token shards (trainmesh data prepare's output: its "
                    f"{MANIFEST}), not documents. Fix: name the text it was prepared from (its {MANIFEST} lists "
                    f"the inputs); to train on it, --data.source={given}."
                )
            found = _walk(given, skipped)
            if not found:
                raise SourceError(
                    f"input folder {str(given)!r} holds no file prepare reads (text {', '.join(TEXT_SUFFIXES)}; "
                    f"JSON Lines {', '.join(JSONL_SUFFIXES)}; {PARQUET_SUFFIX}; a saved Hugging Face dataset). "
                    "Fix: name the files themselves (any suffix is read as text)."
                )
            sources += found
        else:
            source = _file_source(given, explicit=True)
            assert source is not None  # a named file is read as text at least
            sources.append(source)
    _refuse_duplicates(sources)
    if skipped:
        kinds = ", ".join(f"{n} {suffix or '(no suffix)'}" for suffix, n in sorted(skipped.items()))
        log.info("skipped %d file(s) of other kinds in the input folders: %s", sum(skipped.values()), kinds)
    return sources


def text_source(path: Path) -> Source:
    """A file read as one text document (decompressed by its suffix), whatever its name."""
    return Source(path, "text", _compression(path.name.lower()))


def check_readers(sources: Sequence[Source]) -> None:
    """Refuse before any work when a source needs a package that is not installed (found, not imported yet:
    `datasets` takes seconds to import), or is a saved dataset whose Arrow data is damaged (before `datasets`
    reads a file of it: a damaged one crashed the process; and before hours of hashing and tokenising)."""
    needs = {"parquet": "pyarrow", "hf": "datasets"}
    for source in sources:
        # A top-level name: finding `pyarrow.parquet` imports `pyarrow`, which raises when it is not installed.
        if source.kind in needs and importlib.util.find_spec(needs[source.kind]) is None:
            _not_installed(needs[source.kind], source)
    for source in sources:
        if source.kind == "hf":
            check_saved_dataset(source.path)


def read_pieces(source: Source, text_field: str) -> Iterator[Piece]:
    """The documents of one source that `check_readers` accepted, in order, as pieces."""
    if source.kind == "text":
        with _open(source) as (raw, stream):
            yield from text_pieces(source.path, stream, position=raw.tell)
    elif source.kind == "jsonl":
        yield from _jsonl_pieces(source, text_field)
    elif source.kind == "parquet":
        yield from _parquet_pieces(source, text_field)
    else:
        yield from _dataset_pieces(source, text_field)


def _walk(folder: Path, skipped: Counter[str]) -> list[Source]:
    found: list[Source] = []
    visited: set[tuple[int, int]] = set()

    def visit(directory: Path) -> None:
        stat = directory.stat()
        if (stat.st_dev, stat.st_ino) in visited:  # a symlink back up the tree, or to a folder seen already
            log.info("not walking %s again (a symlink to a folder already read)", directory)
            return
        visited.add((stat.st_dev, stat.st_ino))
        dataset = _dataset_source(directory)
        if dataset is not None:
            found.append(dataset)
            return
        if prepared_files(directory) is not None:  # its manifest.json is no JSON Lines, its .bin no text
            log.warning(
                "not reading %s: a folder of prepared token shards (trainmesh data prepare's output), not documents",
                directory,
            )
            return
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            path = Path(entry.path)
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                visit(path)
            elif entry.is_file():
                source = _file_source(path, explicit=False)
                if source is None:
                    skipped[path.suffix.lower()] += 1
                else:
                    found.append(source)

    visit(folder)
    return found


def _file_source(path: Path, explicit: bool) -> Source | None:
    """The source a file is, from its suffix; None for another kind found in a folder (explicit: text)."""
    name = path.name.lower()
    compression = _compression(name)
    inner = name[: len(name) - len(compression)]
    if name.endswith(NOT_READ):
        if not explicit:
            return None
        raise SourceError(
            f"input {str(path)!r} is compressed in a format prepare does not read (it reads .gz, .bz2 and .xz). "
            "Fix: decompress it first (e.g. zstd -d FILE), and name the result."
        )
    if inner.endswith(PARQUET_SUFFIX):
        if compression:
            raise SourceError(f"input {str(path)!r}: a compressed Parquet file. Fix: decompress it first.")
        return Source(path, "parquet")
    if inner.endswith(JSONL_SUFFIXES):
        return Source(path, "jsonl", compression)
    if inner.endswith(TEXT_SUFFIXES) or explicit:
        return Source(path, "text", compression)
    return None


def _compression(name: str) -> str:
    return next((suffix for suffix in OPENERS if name.endswith(suffix)), "")


def _dataset_source(folder: Path) -> Source | None:
    """A Hugging Face dataset saved by `save_to_disk` (one split, or a DatasetDict: its train split)."""
    if (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file():
        return Source(folder, "hf")
    if not (folder / "dataset_dict.json").is_file():
        return None
    splits = _split_names(folder / "dataset_dict.json")
    if "train" in splits or len(splits) == 1:
        split = "train" if "train" in splits else splits[0]
        log.info("%s is a DatasetDict of splits %s: reading its %r split", folder, splits, split)
        return Source(folder / split, "hf")
    raise SourceError(
        f"{folder} is a saved DatasetDict with splits {splits} and no 'train' split; prepare reads one. "
        f"Fix: name the split's folder, e.g. {folder / splits[0]}."
    )


def _split_names(path: Path) -> list[str]:
    """The splits a DatasetDict's dataset_dict.json lists: each the name of a folder beside it, read as such (a
    name like "../x" would read a folder outside the dataset)."""
    fix = "Fix: save the dataset again (DatasetDict.save_to_disk), or name one split's folder itself."
    try:
        body = read_json(path, MAX_JSON_BYTES)
    except JsonFileError as e:
        raise SourceError(f"{e}, so {path.parent} is not a saved DatasetDict prepare reads. {fix}") from None
    splits = body.get("splits") if isinstance(body, dict) else None
    if not isinstance(splits, list) or not splits or not all(is_plain_name(split) for split in splits):
        shown = "missing" if splits is None else str(splits)[:200]
        raise SourceError(f'{path}: its "splits" is {shown}, not a list of the names of folders beside it. {fix}')
    return splits


def _refuse_duplicates(sources: list[Source]) -> None:
    seen: dict[Path, Path] = {}
    for source in sources:
        real = source.path.resolve()
        if real in seen:
            raise SourceError(
                f"{source.path} would be read twice (as {seen[real]} too: named twice, or inside a folder also "
                "named, or through a symlink), which would put its documents in the corpus twice. "
                "Fix: name each input once."
            )
        seen[real] = source.path


def _require(module: str, package: str, source: Source) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        _not_installed(package, source)


def _not_installed(package: str, source: Source) -> NoReturn:
    raise SourceError(
        f"reading {source.path} ({source.kind}) needs the Python package {package!r}, which is not installed. "
        f"Fix: {INSTALL_DATA}."
    )


@contextmanager
def _open(source: Source) -> Iterator[tuple[IO[bytes], IO[bytes]]]:
    """The source's file (`raw`, whose position tells the progress) and its decompressed byte stream."""
    try:
        raw = source.path.open("rb")
    except OSError as e:
        raise SourceError(f"cannot read input {source.path}: {e.strerror}") from None
    try:
        opener = OPENERS.get(source.compression)
        yield raw, (opener(fileobj=raw, mode="rb") if opener else raw)
    except (OSError, EOFError, zlib.error, lzma.LZMAError) as e:  # a damaged or truncated compressed file
        raise SourceError(f"input {source.path} cannot be read: {e}") from None
    finally:
        raw.close()


def _jsonl_pieces(source: Source, field: str) -> Iterator[Piece]:
    with _open(source) as (raw, stream):
        done, surrogates = 0, 0
        for number, line in _lines(stream, source.path):
            if not line.strip():
                continue
            where = f"{source.path}:{number}"
            text = _json_text(line, field, where)
            if not text.isascii() and _SURROGATE.search(text):
                surrogates += 1
                if surrogates == 1:
                    log.warning(
                        "%s: %r holds a lone UTF-16 surrogate (half of a pair: text cut inside an emoji, say), which "
                        "UTF-8 cannot encode; it becomes U+FFFD, here and in any later record of this file",
                        where,
                        field,
                    )
                text = _SURROGATE.sub("\ufffd", text)
            position = raw.tell()
            yield Piece(text, True, position - done)
            done = position
    if surrogates > 1:
        log.info("%s: %d records held lone surrogates, made U+FFFD", source.path, surrogates)


def _lines(stream: IO[bytes], path: Path) -> Iterator[tuple[int, bytes]]:
    """The stream's lines and their numbers, each read with a bound: a longer line is refused, never held."""
    number = 0
    while line := stream.readline(MAX_RECORD_BYTES + 1):
        number += 1
        if len(line) > MAX_RECORD_BYTES:
            raise SourceError(
                f"{path}:{number}: a JSON Lines record longer than {MAX_RECORD_BYTES:,} bytes, the most prepare reads "
                "as one (it holds a record whole in memory, and its text several times over). Fix: split that "
                "document into several records, or give its text as a .txt file (text files stream, any size)."
            )
        yield number, line


def _json_text(line: bytes, field: str, where: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise SourceError(
            f"{where}: not JSON ({e}). A JSON Lines file holds one JSON object per line. "
            "Fix: repair or remove that line."
        ) from None
    except RecursionError:  # Python's parser recurses once a level: 100,000 '[' exhaust it
        raise SourceError(
            f"{where}: JSON nested more deeply than Python's parser reads (about {sys.getrecursionlimit():,} "
            "levels). A JSON Lines record is an object whose text field is a string. Fix: repair or remove that line."
        ) from None
    if not isinstance(record, dict):
        raise SourceError(f"{where}: a JSON {type(record).__name__}, not an object with a {field!r} field")
    if field not in record:
        fields = ", ".join(sorted(map(str, record))) or "none"
        raise SourceError(
            f"{where}: no field {field!r} (its fields: {fields}). Fix: --text-field=<the field holding the text>."
        )
    return _as_text(record[field], field, where)


def _as_text(value: Any, field: str, where: str) -> str:
    if not isinstance(value, str):
        raise SourceError(
            f"{where}: {field!r} is {'null' if value is None else 'a ' + type(value).__name__}, not a string. "
            "Fix: --text-field=<the field holding the text>, or remove the record."
        )
    return value


def _parquet_pieces(source: Source, field: str) -> Iterator[Piece]:
    pq = _require("pyarrow.parquet", "pyarrow", source)
    try:
        table = pq.ParquetFile(source.path)
    except Exception as e:  # pyarrow's ArrowInvalid and OSError: not a Parquet file
        raise SourceError(f"input {source.path} is not a readable Parquet file: {e}") from None
    columns = table.schema_arrow.names
    if field not in columns:
        raise SourceError(
            f"{source.path} has no column {field!r} (its columns: {', '.join(columns)}). "
            "Fix: --text-field=<the column holding the text>."
        )
    size, rows = source.path.stat().st_size, max(1, table.metadata.num_rows)
    read = table.iter_batches(batch_size=ROWS_PER_BATCH, columns=[field])
    batches = (b.column(0).to_pylist() for b in validated(read, source.path))
    yield from _row_pieces(batches, field, str(source.path), size, rows)


def _dataset_pieces(source: Source, field: str) -> Iterator[Piece]:
    datasets = _require("datasets", "datasets", source)
    try:
        dataset = datasets.load_from_disk(str(source.path))
    except Exception as e:  # datasets raises FileNotFoundError and its own errors for damaged folders
        raise SourceError(f"input {source.path} is not a readable saved Hugging Face dataset: {e}") from None
    if field not in dataset.column_names:
        raise SourceError(
            f"{source.path} has no column {field!r} (its columns: {', '.join(dataset.column_names)}). "
            "Fix: --text-field=<the column holding the text>."
        )
    size = sum(p.stat().st_size for p in source.files())
    batches = (b[field] for b in dataset.select_columns([field]).iter(batch_size=ROWS_PER_BATCH))
    yield from _row_pieces(batches, field, str(source.path), size, max(1, len(dataset)))


def _row_pieces(batches: Iterator[list[Any]], field: str, where: str, size: int, rows: int) -> Iterator[Piece]:
    """One piece a row; each row stands for an equal share of the file's bytes."""
    row, done = 0, 0
    for batch in batches:
        for value in batch:
            text = _as_text(value, field, f"{where}: row {row}")
            row += 1
            position = size * row // rows
            yield Piece(text, True, position - done)
            done = position
