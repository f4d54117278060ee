"""Each worker's exit code, told to the launcher on its node through a folder of records, so that a stop with a
checkpoint (exit 75) is claimed only when it happened.

Details: docs/internals.md#launchexit_recordspy
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trainmesh.core.env import read_var, vars_set

ENV_VAR = "TRAINMESH_EXIT_RECORDS"
_PREFIX = "local_rank_"


@dataclass(frozen=True)
class ExitRecord:
    rank: int | None
    """the worker's global rank (None: its record could not be read)"""
    exit_code: int | None
    """None: it started and has not returned (killed, or crashed: an exception is no return)"""
    stopped_with_checkpoint: bool = False
    """it stopped at a step boundary, on SIGTERM or Ctrl-C, with a committed checkpoint"""


@contextlib.contextmanager
def records_folder() -> Iterator[Path]:
    """The launcher's side: a fresh folder, named to the workers it starts while inside (by the environment
    they inherit), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="trainmesh-exits-"))
    try:
        with vars_set({ENV_VAR: str(folder)}):
            yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def read_records(folder: Path) -> dict[int, ExitRecord]:
    """The records of the workers that started, by local rank (one that never started has none)."""
    records: dict[int, ExitRecord] = {}
    for path in folder.glob(f"{_PREFIX}*"):
        local_rank = path.name.removeprefix(_PREFIX)
        if not local_rank.isdigit():  # one being written
            continue
        try:
            record = json.loads(path.read_text())
            records[int(local_rank)] = ExitRecord(
                int(record["rank"]), record["exit_code"], bool(record["stopped_with_checkpoint"])
            )
        except (OSError, ValueError, KeyError, TypeError):  # unreadable: as if it had not returned
            records[int(local_rank)] = ExitRecord(None, None)
    return dict(sorted(records.items()))


def record_start() -> None:
    """The worker's side, first thing: this rank runs (a record of an earlier attempt is replaced)."""
    _write(None, False)


def record_exit(code: int, *, stopped_with_checkpoint: bool) -> None:
    """The worker's side, last thing: the exit code it returns, and whether it stopped with a checkpoint (Ctrl-C
    before a step boundary exits 130 too, having saved nothing)."""
    _write(code, stopped_with_checkpoint)


def _write(code: int | None, stopped_with_checkpoint: bool) -> None:
    folder, local_rank, rank = (read_var(key) for key in (ENV_VAR, "LOCAL_RANK", "RANK"))
    if not folder or not local_rank.isdigit() or not rank.isdigit():
        return
    path = Path(folder) / f"{_PREFIX}{local_rank}"
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    with contextlib.suppress(OSError):  # the launcher's report loses a line; the run goes on
        record = {"rank": int(rank), "exit_code": code, "stopped_with_checkpoint": stopped_with_checkpoint}
        partial.write_text(json.dumps(record))
        partial.replace(path)  # the launcher reads a whole record, or the one before
