"""Arrow data that prepare reads (a saved dataset's files, Parquet's batches), validated in full before it is read, so a
damaged or tampered file is an error, not a segfault.

Details: docs/internals.md#dataarrowfilespy
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainmesh.core.errors import UserError
from trainmesh.core.files import is_plain_name, read_json

STATE = "state.json"
MAX_STATE_BYTES = 16 << 20  # a state.json names its files: kilobytes, megabytes for tens of thousands of files


class DamagedInputError(UserError, ValueError):
    """A saved dataset or Parquet file whose data fails validation."""


def check_saved_dataset(folder: Path) -> None:
    """Validate the Arrow files `datasets.load_from_disk(folder)` would read; refuses a damaged one."""
    try:
        files = saved_data_files(folder)
    except ValueError as e:
        raise DamagedInputError(f"input {folder} is not a readable saved Hugging Face dataset: {e}") from None
    for path in files:
        try:
            check_arrow_file(path)
        except ValueError as e:
            raise DamagedInputError(
                f"input {folder}: its Arrow file {path.name} is damaged ({e}); prepare reads none of it. "
                "Fix: save the dataset again (save_to_disk), or restore that file from a copy."
            ) from None


def saved_data_files(folder: Path) -> list[Path]:
    """The Arrow files `datasets.load_from_disk(folder)` reads, as its state.json lists them; ValueError when
    state.json cannot be read (core/files.py JsonFileError) or names a file that is not in `folder` itself."""
    state = read_json(folder / STATE, MAX_STATE_BYTES)
    try:
        names = [entry["filename"] for entry in state["_data_files"]]
    except (KeyError, TypeError):
        raise ValueError(f'{STATE} is not a saved dataset\'s: it has no "_data_files": [{{"filename": ...}}]') from None
    for name in names:
        if not is_plain_name(name):
            raise ValueError(f"{STATE} lists {name!r}, which is not the name of a file in the dataset's folder")
    return [folder / name for name in names]


def check_arrow_file(path: Path) -> None:
    """Validate every record batch of an Arrow IPC stream file (as `save_to_disk` writes them) in full;
    ValueError saying what is wrong, and in which batch."""
    import pyarrow as pa  # an optional dependency: imported once a saved dataset is read

    try:
        with pa.memory_map(str(path)) as source:
            for number, batch in enumerate(pa.ipc.open_stream(source)):
                try:
                    batch.validate(full=True)
                except pa.ArrowException as e:
                    raise ValueError(f"record batch {number}: {e}") from None
    except (pa.ArrowException, OSError) as e:  # not an Arrow stream, or a truncated one
        raise ValueError(str(e)) from None


def validated(batches: Iterator[Any], path: Path) -> Iterator[Any]:
    """The record batches of the Parquet file at `path`, each validated in full before it is handed on."""
    import pyarrow as pa

    rows = 0
    while True:
        try:
            batch = next(batches, None)
            if batch is None:
                return
            batch.validate(full=True)
        except (pa.ArrowException, OSError) as e:  # a damaged page, a string that is not UTF-8
            raise DamagedInputError(
                f"input {path} is damaged in the rows from {rows:,} on ({e}); nothing is written. "
                "Fix: write the file again, or restore it from a copy."
            ) from None
        yield batch
        rows += batch.num_rows
