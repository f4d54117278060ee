"""What `trainmesh data prepare` reads: input paths turned into sources, and sources into documents.

Inputs are files and folders. A folder is walked recursively, depth first, each folder's entries in sorted
name order, skipping hidden entries (a leading dot) and files of other kinds, following symlinks but never
into a folder already visited (so a symlink loop ends). A folder holding a Hugging Face dataset written by
`save_to_disk` is one source, not walked into. A folder of token shards an earlier prepare wrote (its
manifest.json is trainmesh's) is skipped with a warning: its manifest is no JSON Lines file, its shards no
text; named as an input itself, it is refused. A file named on the command line is read by its suffix, and
as text when the suffix is none of these:

| kind    | suffixes                          | a document is                                   |
|---------|-----------------------------------|-------------------------------------------------|
| text    | .txt .text .md .markdown .rst     | the whole file                                  |
| jsonl   | .jsonl .ndjson .json              | one line: a JSON object, its `--text-field`     |
| parquet | .parquet                          | one row: its `--text-field` column              |
| hf      | a `save_to_disk` folder           | one row: its `--text-field` column              |

Text and JSON Lines files may be compressed: .gz, .bz2, .xz (read by the standard library as they stream).
A JSON Lines line that is not an object with a string `--text-field` stops the run with an error naming
file:line (blank lines are skipped): it is a wrong `--text-field` or a damaged file far more often than a
document worth dropping, and a silent skip would change the data unseen. Parquet and dataset rows whose
text is null stop it likewise, naming the row.
"""

from __future__ import annotations

import bz2
import gzip
import importlib
import json
import lzma
import os
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from trainmesh.core.errors import UserError
from trainmesh.core.logging import get_logger
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
    """Refuse before any work when a source needs a package that is not installed."""
    needs = {"parquet": ("pyarrow.parquet", "pyarrow"), "hf": ("datasets", "datasets")}
    for source in sources:
        if source.kind in needs:
            module, package = needs[source.kind]
            _require(module, package, source)


def read_pieces(source: Source, text_field: str) -> Iterator[Piece]:
    """The documents of one source, in order, as pieces."""
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
    try:
        splits = list(json.loads((folder / "dataset_dict.json").read_text())["splits"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SourceError(f"{folder}/dataset_dict.json is not a saved DatasetDict's: {e}") from None
    if "train" in splits or len(splits) == 1:
        split = "train" if "train" in splits else splits[0]
        log.info("%s is a DatasetDict of splits %s: reading its %r split", folder, splits, split)
        return Source(folder / split, "hf")
    raise SourceError(
        f"{folder} is a saved DatasetDict with splits {splits} and no 'train' split; prepare reads one. "
        f"Fix: name the split's folder, e.g. {folder / splits[0]}."
    )


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
        raise SourceError(
            f"reading {source.path} ({source.kind}) needs the Python package {package!r}, which is not "
            f"installed. Fix: {INSTALL_DATA}."
        ) from None


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
        done = 0
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            text = _json_text(line, field, f"{source.path}:{number}")
            position = raw.tell()
            yield Piece(text, True, position - done)
            done = position


def _json_text(line: bytes, field: str, where: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise SourceError(
            f"{where}: not JSON ({e}). A JSON Lines file holds one JSON object per line. "
            "Fix: repair or remove that line."
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
    batches = (b.column(0).to_pylist() for b in table.iter_batches(batch_size=ROWS_PER_BATCH, columns=[field]))
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
