"""Saving and loading one checkpoint with torch.distributed.checkpoint (DCP), every rank in parallel, and the layout of
a checkpoint folder. DCP and the reader are imported where a checkpoint is read: with the DTensor they import, a second
of start-up that a run which never resumes does not pay.

Details: docs/internals.md#checkpointdcppy
"""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from torch import nn

from trainmesh.checkpoint.rank_files import (
    RANK_DIR,
    UntrustedCheckpointError,
    as_numpy_state,
    as_python_state,
    read_rank_file,
)
from trainmesh.checkpoint.state import TrainerState
from trainmesh.core.errors import UserError
from trainmesh.core.logging import get_logger

if TYPE_CHECKING:
    from trainmesh.runtime.runtime import Runtime

log = get_logger(__name__)
E = TypeVar("E", bound=BaseException)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, runtime: Runtime) -> TrainerState:
    """Collective: load model and optimizer (resharded to this world size) and return the trainer state."""
    state = TrainerState.read(path)
    model_state, optim_state = runtime.state_dicts(model, optimizer)  # templates to fill in
    ours = {key: tuple(value.shape) for key, value in model_state.items() if isinstance(value, torch.Tensor)}
    if not runtime.strategy.holds_whole_model:  # pipeline stages: the model is what all ranks hold together
        ours = {key: shape for part in runtime.all_gather_object(ours) for key, shape in part.items()}
    _check_matches(path, ours)
    loaded = {"model": model_state, "optim": optim_state}
    _load(loaded, path)
    runtime.load_state_dicts(model, optimizer, loaded["model"], loaded["optim"])
    runtime.precision.load_state_dict(state.precision)
    rng_file = path / RANK_DIR / f"rank_{runtime.rank}.pt"
    if state.world_size == runtime.world_size and rng_file.is_file():
        rank_state = read_rank_file(rng_file)  # checked already, when the checkpoint was chosen (catalog.py)
        _set_rng_state(rank_state)
        runtime.strategy.load_rank_state(rank_state.get("strategy", {}))
    else:
        log.warning(
            "checkpoint from world size %d: RNG streams (and a comm hook's per-rank state) restart afresh",
            state.world_size,
        )
    log.info("resumed from %s (step %d)", path, state.step)
    return state


class CheckpointMismatchError(UserError, ValueError):
    """The checkpoint holds a different model (names or shapes); nothing was loaded."""


def _check_matches(path: Path, ours: dict[str, tuple[int, ...]]) -> None:
    """Compare the model's parameter names and (global) shapes with the checkpoint's metadata before
    loading anything."""
    from trainmesh.checkpoint.reader import saved_tensors

    saved = {
        key.removeprefix("model."): tuple(meta.size)
        for key, meta in saved_tensors(path).items()
        if key.startswith("model.")
    }
    missing, unexpected = sorted(ours.keys() - saved.keys()), sorted(saved.keys() - ours.keys())
    common = sorted(ours.keys() & saved.keys())
    shapes = [f"{k}: {saved[k]} in the checkpoint, {ours[k]} in the model" for k in common if saved[k] != ours[k]]
    if not (missing or unexpected or shapes):
        return
    problems = [
        *([f"missing from the checkpoint: {', '.join(missing)}"] if missing else []),
        *([f"not in the model: {', '.join(unexpected)}"] if unexpected else []),
        *([f"different shapes: {'; '.join(shapes)}"] if shapes else []),
    ]
    raise CheckpointMismatchError(
        f"{path} holds a different model; nothing was loaded.\n  " + "\n  ".join(problems) + "\n"
        "Fix: resume with the [model] settings of the run that saved it (its config.toml; "
        "trainmesh ckpt inspect shows them), or start a new run (--run-id) instead of --resume. A checkpoint "
        f"saved by an older trainmesh may only need converting: trainmesh ckpt upgrade {path}"
    )


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns that it 'assumes a single process' when there is no process group: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def read_full_state(path: Path) -> dict[str, Any]:
    """Every value of a checkpoint, in one process and without a process group ({"model": {...},
    "optim": {...}}, nested as it was saved); for inspection, comparison and export."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from trainmesh.checkpoint.reader import read_metadata, set_path

    metadata = read_metadata(path)
    flat: dict[str, Any] = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else None
        for key, meta in metadata.state_dict_metadata.items()
    }
    _load(flat, path, no_dist=True)
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        set_path(nested, _nesting(paths.get(key), key), value)
    return nested


def _load(state: dict[str, Any], path: Path, no_dist: bool = False) -> None:
    """dcp.load through the safe reader and planner; a refusal comes out as itself, not wrapped in DCP's
    CheckpointException (which names only the ranks)."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException

    from trainmesh.checkpoint.reader import SafeLoadPlanner, SafeReader

    try:
        with single_process_quiet():
            load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as e:
        refusal = find_cause(e, UntrustedCheckpointError)
        if refusal is not None:
            raise UntrustedCheckpointError(f"{path}: {refusal}") from None
        raise


def find_cause(error: BaseException | None, kind: type[E]) -> E | None:
    """The first exception of `kind` in `error`, its causes and contexts, and the per-rank failures DCP
    wraps in a CheckpointException."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen: set[int] = set()
    todo = [error]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, kind):
            return current
        if isinstance(current, CheckpointException):
            todo += [exc for exc, _ in current.failures.values()]
        todo += [current.__cause__, current.__context__]
    return None


def _nesting(path: Any, key: str) -> tuple[str | int, ...]:
    """Where DCP's planner data puts a flat key, when it is a plain path (else the key itself)."""
    if not isinstance(path, tuple) or not path or not isinstance(path[0], str):
        return (key,)
    plain = all(isinstance(k, str) or (isinstance(k, int) and 0 <= k < 2**20) for k in path)
    return path if plain else (key,)


def rng_state() -> dict[str, Any]:
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [
            np_kind,
            torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            np_pos,
            np_has_gauss,
            np_gauss,
        ],
        "python": [py_version, torch.tensor(py_state, dtype=torch.int64), py_gauss],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    np.random.set_state(as_numpy_state(state["numpy"]))
    random.setstate(as_python_state(state["python"]))
