"""Checkpoints: DCP shards, committed by rename, with trainer state and per-rank RNG."""

from trainmesh.checkpoint.dcp import (
    TrainerState,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_full_state,
    save_checkpoint,
    step_dir,
)

__all__ = [
    "TrainerState",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_full_state",
    "save_checkpoint",
    "step_dir",
]
