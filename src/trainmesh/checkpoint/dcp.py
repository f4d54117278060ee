"""Saving and loading one checkpoint with torch.distributed.checkpoint (DCP), every rank in parallel.

Layout of one checkpoint, `<run>/checkpoints/step_00000300/`:
    *.distcp, .metadata     model and optimizer (DCP; reshardable to another world size/strategy)
    trainer_state.json      step, samples seen, precision (GradScaler) state, config, versions
    rng/rank_<r>.pt         each rank's RNG states (torch, CUDA, NumPy, Python) — tensors only
    manifest.json           size and SHA-256 of every file above (see manifest.py)

A checkpoint is written under a temporary name, hashed and fsynced, and renamed into place only then,
so a directory named `step_*` is complete; resuming verifies it against its manifest before anything
in it is parsed (catalog.py). Everything non-tensor is JSON, and RNG files load with `weights_only=True`.
"""

from __future__ import annotations

import contextlib
import json
import random
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainmesh.runtime.logging import get_logger

if TYPE_CHECKING:
    from trainmesh.runtime.runtime import Runtime

log = get_logger(__name__)

TRAINER_STATE = "trainer_state.json"


@dataclass
class TrainerState:
    """Everything besides tensors that a resume needs."""

    step: int = 0
    """Optimizer steps completed; with the global batch it fixes the data position."""
    samples_seen: int = 0
    """Samples consumed over all ranks."""
    world_size: int = 1
    precision: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, runtime: Runtime) -> TrainerState:
    """Collective: load model and optimizer (resharded to this world size) and return the trainer state."""
    state = TrainerState(**json.loads((path / TRAINER_STATE).read_text()))
    model_state, optim_state = runtime.strategy.state_dicts(model, optimizer)  # templates to fill in
    ours = {key: tuple(value.shape) for key, value in model_state.items() if isinstance(value, torch.Tensor)}
    if not runtime.strategy.holds_whole_model:  # pipeline stages: the model is what all ranks hold together
        ours = {key: shape for part in runtime.all_gather_object(ours) for key, shape in part.items()}
    _check_matches(path, ours)
    loaded = {"model": model_state, "optim": optim_state}
    with single_process_quiet():
        dcp.load(loaded, checkpoint_id=str(path))
    runtime.strategy.load_state_dicts(model, optimizer, loaded["model"], loaded["optim"])
    runtime.precision.load_state_dict(state.precision)
    rng_file = path / "rng" / f"rank_{runtime.rank}.pt"
    if state.world_size == runtime.world_size and rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        log.warning("checkpoint from world size %d: RNG streams restart from the seed", state.world_size)
    log.info("resumed from %s (step %d)", path, state.step)
    return state


class CheckpointMismatchError(ValueError):
    """The checkpoint holds a different model (names or shapes); nothing was loaded."""


def saved_tensors(path: Path) -> dict[str, TensorStorageMetadata]:
    """Name -> shape, dtype of every tensor in a checkpoint ("model.*", "optim.*"), from DCP's metadata
    (a pickle: call this only on a checkpoint verified against its manifest)."""
    metadata = FileSystemReader(str(path)).read_metadata()
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _check_matches(path: Path, ours: dict[str, tuple[int, ...]]) -> None:
    """Compare the model's parameter names and (global) shapes with the checkpoint's metadata before
    loading anything."""
    saved = {
        key.removeprefix("model."): tuple(meta.size)
        for key, meta in saved_tensors(path).items()  # verified against the manifest already
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
        "trainmesh ckpt inspect shows them), or start a new run (--run-id) instead of --resume."
    )


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns that it 'assumes a single process' when there is no process group: that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def read_full_state(path: Path) -> dict[str, Any]:
    """Every tensor of a committed checkpoint, in one process and without a process group
    ({"model": {...}, "optim": {...}}); for inspection, comparison and export."""
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "full.pt"
        with single_process_quiet():
            dcp_to_torch_save(str(path), str(target))
        return dict(torch.load(target, weights_only=True))


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
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(int(x) for x in py_state.tolist()), py_gauss))
