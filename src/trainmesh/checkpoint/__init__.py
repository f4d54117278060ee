"""Checkpoints: DCP shards committed by rename after a manifest of hashes, verified before resuming."""

from trainmesh.checkpoint.catalog import (
    CorruptCheckpointError,
    find_resumable,
    latest_checkpoint,
    list_checkpoints,
    step_dir,
)
from trainmesh.checkpoint.dcp import TrainerState, load_checkpoint, read_full_state, save_checkpoint
from trainmesh.checkpoint.manifest import verify

__all__ = [
    "CorruptCheckpointError",
    "TrainerState",
    "find_resumable",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_full_state",
    "save_checkpoint",
    "step_dir",
    "verify",
]
