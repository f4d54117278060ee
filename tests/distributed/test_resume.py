"""Checkpoint and resume through DCP. A run that checkpoints at step 3 of 6 is the reference; a copy of
its run directory without the later checkpoints stands for a run killed after step 3. Resuming the copy
must reproduce the reference bit for bit (2 ranks, dropout on, so RNG state matters), and a 2-rank
checkpoint must resume on 1 rank (DCP reshards; the global sample order does not depend on ranks)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from support import train_rank
from trainmesh.checkpoint import list_checkpoints
from trainmesh.testing import DistributedTestError, run_distributed

pytestmark = pytest.mark.slow

COMMON = ["--train.micro_batch=4", "--train.global_batch=8", "--train.max_steps=6", "--checkpoint.every=3"]


def _interrupted_copy(root: Path, name: str) -> None:
    """runs/<name> as if the job had died right after committing the step-3 checkpoint."""
    shutil.copytree(root / "runs" / "full", root / "runs" / name)
    for checkpoint in list_checkpoints(root / "runs" / name)[1:]:
        shutil.rmtree(checkpoint)
    assert [p.name for p in list_checkpoints(root / "runs" / name)] == ["step_00000003"]


def test_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    common = [*COMMON, "--model.dropout=0.1", "--checkpoint.final=true"]
    full = run_distributed(train_rank, 2, args=(str(tmp_path), [*common, "--run.id=full"]))
    _interrupted_copy(tmp_path, "resumed")
    resume = [*common, "--run.id=resumed", "--checkpoint.resume=true"]
    resumed = run_distributed(train_rank, 2, args=(str(tmp_path), resume))
    for key, value in full[0]["params"].items():
        assert torch.equal(resumed[0]["params"][key], value), key
    assert resumed[0]["train_loss"] == full[0]["train_loss"]


def test_two_rank_checkpoint_resumes_on_one_rank(tmp_path: Path) -> None:
    full = run_distributed(train_rank, 2, args=(str(tmp_path), [*COMMON, "--run.id=full"]))
    _interrupted_copy(tmp_path, "one")
    # One rank now does the work of two: micro-batch 8, the same global batch and sample order.
    one = [*COMMON, "--train.micro_batch=8", "--run.id=one", "--checkpoint.resume=true"]
    resumed = run_distributed(train_rank, 1, args=(str(tmp_path), one))
    for key, value in full[0]["params"].items():
        torch.testing.assert_close(resumed[0]["params"][key], value, atol=2e-5, rtol=1e-4, msg=key)


def test_a_model_that_does_not_match_the_checkpoint_is_refused_with_the_keys(tmp_path: Path) -> None:
    """Resuming a 2-layer run's checkpoint with 3 layers and a wider embedding: every missing or
    reshaped parameter is named, and nothing is loaded."""
    first = ["--train.max_steps=2", "--checkpoint.final=true", "--run.id=mm"]
    run_distributed(train_rank, 1, args=(str(tmp_path), first))
    changed = [*first, "--train.max_steps=4", "--checkpoint.resume=true", "--model.n_layer=3", "--model.n_embd=48"]
    with pytest.raises(DistributedTestError, match="holds a different model; nothing was loaded") as info:
        run_distributed(train_rank, 1, args=(str(tmp_path), changed))
    message = str(info.value)
    assert "missing from the checkpoint: blocks.2." in message
    assert "wte.weight: (256, 32) in the checkpoint, (256, 48) in the model" in message
