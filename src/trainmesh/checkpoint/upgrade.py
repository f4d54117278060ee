"""`trainmesh ckpt upgrade`: rewrite a checkpoint saved by an older trainmesh in the current layout, offline. The recipe
converts the tensors; this module verifies, writes the new checkpoint beside the old and swaps them.

Details: docs/internals.md#checkpointupgradepy
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from trainmesh.checkpoint.catalog import check_checkpoint
from trainmesh.checkpoint.dcp import read_full_state, single_process_quiet
from trainmesh.checkpoint.manifest import MANIFEST, verify, write_manifest_here
from trainmesh.checkpoint.state import TRAINER_STATE, TrainerState
from trainmesh.core.errors import UserError
from trainmesh.core.files import fsync_dir
from trainmesh.core.logging import get_logger

log = get_logger(__name__)

Converter = Callable[[dict[str, Any], TrainerState], list[str]]
"""Converts a checkpoint's full state ({"model": ..., "optim": ...}) in place; returns one line per change
made (empty: the checkpoint is already current)."""

BACKUP_SUFFIX = ".pre-upgrade"


class UpgradeError(UserError, ValueError):
    """The checkpoint cannot be upgraded (damaged, or the result did not verify); nothing was changed."""


def upgrade_checkpoint(path: Path, convert: Converter) -> list[str]:
    """Rewrite the checkpoint at `path` in the current layout; returns the changes ([]: left untouched)."""
    if path.is_symlink():
        raise UpgradeError(f"{path} is a symbolic link; upgrade the checkpoint it points to, by its own path")
    problems = check_checkpoint(path)
    if problems:
        raise UpgradeError(f"{path} does not verify, so it was not upgraded:\n  " + "\n  ".join(problems))
    trainer_state = TrainerState.read(path)
    state = read_full_state(path)
    try:
        changes = convert(state, trainer_state)
    except (KeyError, ValueError, RuntimeError, TypeError) as e:  # a config or tensors the recipe cannot map
        raise UpgradeError(f"{path} cannot be converted ({type(e).__name__}: {e}); nothing was changed") from None
    if not changes:
        return []
    staging = path.with_name(f".{path.name}.upgrade.tmp")
    if staging.is_symlink() or staging.is_file():
        staging.unlink()  # not ours to follow
    shutil.rmtree(staging, ignore_errors=True)  # a leftover of an interrupted upgrade
    staging.mkdir()
    try:
        _write(staging, state, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    backup = _free_name(path.with_name(path.name + BACKUP_SUFFIX))
    path.rename(backup)
    staging.rename(path)
    fsync_dir(path.parent)
    log.info("upgraded %s; the original is kept as %s (delete it once the run resumes)", path, backup)
    return changes


def _write(folder: Path, state: dict[str, Any], original: Path) -> None:
    with single_process_quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    shutil.copy2(original / TRAINER_STATE, folder / TRAINER_STATE)
    if (original / "rng").is_dir():
        shutil.copytree(original / "rng", folder / "rng", symlinks=True)
    write_manifest_here(folder)
    for written in (folder / "rng", folder):
        if written.is_dir():
            fsync_dir(written)  # the names in them are durable before the swap makes the copy the checkpoint
    verdict = verify(folder)
    if not verdict.ok or not (folder / MANIFEST).is_file():
        raise UpgradeError(f"the upgraded copy of {original} did not verify: {'; '.join(verdict.problems)}")


def _free_name(target: Path) -> Path:
    n, candidate = 1, target
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = target.with_name(f"{target.name}{n}")
    return candidate
