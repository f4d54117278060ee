"""Checkpoints: DCP shards committed by rename after a manifest of hashes, verified before resuming."""

from trainmesh.checkpoint.catalog import (
    CorruptCheckpointError,
    find_resumable,
    latest_checkpoint,
    list_checkpoints,
    step_dir,
)
from trainmesh.checkpoint.dcp import load_checkpoint, read_full_state
from trainmesh.checkpoint.manifest import verify
from trainmesh.checkpoint.saver import Checkpointer, CheckpointWriteError
from trainmesh.checkpoint.state import TrainerState

__all__ = [
    "CheckpointWriteError",
    "Checkpointer",
    "CorruptCheckpointError",
    "TrainerState",
    "find_resumable",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_full_state",
    "step_dir",
    "verify",
]
