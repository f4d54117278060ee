"""The ResNet recipe through the library on 2 gloo ranks: with SyncBatchNorm, DDP with micro-batch b
reaches the same weights and running statistics as one process with batch 2b (BatchNorm over the same
samples), and so do 2 pipeline stages × 2 replicas (SyncBatchNorm over the replicas of each stage);
with per-rank BatchNorm it does not. Resuming reproduces the uninterrupted run bit for bit
(augmentation is drawn from sample ids, not a global RNG). A short training reports a sane val_top1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from support import assert_same_training
from trainmesh.checkpoint import list_checkpoints
from trainmesh.job.spec import load_config
from trainmesh.job.worker import run_worker
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.slow

TINY = [
    "--model.width=4",
    "--model.image_size=16",
    "--train.max_steps=3",
    "--train.eval_every=0",
    "--train.eval_samples=64",
    "--run.progress=false",
    "--run.log_every=1",
    "--checkpoint.final=false",
    "--optim.warmup_steps=1",
    "--optim.lr=1e-3",
    "--dist.timeout_s=20",  # a rank left waiting in a collective fails the test in seconds
]
# As in test_parity: the reductions differ in order (all-reduce vs one batch), so equality holds to
# fp32 rounding, amplified a little by Adam over 3 steps.
ATOL, RTOL = 2e-5, 1e-4


def resnet_rank(rank: int, root: str, overrides: list[str]) -> dict[str, Any]:
    config = load_config(None, [*TINY, f"--run.out_dir={root}/runs", *overrides], "resnet")
    run_dir = Path(root) / "runs" / config.run.id
    result = run_worker(config, run_dir)
    train = [r for r in _records(run_dir) if r["kind"] == "train"] if rank == 0 else []
    return {
        "rank": rank,
        "state": {k: v.detach().cpu().clone() for k, v in result.model.state_dict().items()},
        "losses": [r["loss"] for r in train],
        "grad_norms": [r["grad_norm"] for r in train],
    }


def _run(root: Path, world: int, overrides: list[str]) -> dict[str, Any]:
    """Rank 0's result: its state (parameters, running statistics) and the per-step log."""
    results = run_distributed(resnet_rank, world, args=(str(root), overrides), timeout_s=60)
    synced = "--model.norm=sync_batch" in overrides
    for key, value in results[0]["state"].items():
        # Replicas agree: parameters through DDP, running statistics when they are synchronised (with
        # per-rank BatchNorm each rank updates rank 0's broadcast statistics with its own batch).
        if world > 1 and (synced or "running" not in key):
            torch.testing.assert_close(results[1]["state"][key], value, atol=0, rtol=0, msg=key)
    return dict(results[0])


def _state(root: Path, world: int, overrides: list[str]) -> dict[str, torch.Tensor]:
    return dict(_run(root, world, overrides)["state"])


def _records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _assert_same(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert got.keys() == reference.keys()
    for key, ref in reference.items():
        torch.testing.assert_close(got[key], ref, atol=ATOL, rtol=RTOL, msg=key)


def test_sync_batchnorm_on_2_ranks_equals_one_process(tmp_path: Path) -> None:
    batch = ["--train.global_batch=16"]
    single = _run(tmp_path, 1, [*batch, "--train.micro_batch=16", "--model.norm=sync_batch", "--run.id=single"])
    synced = _run(tmp_path, 2, [*batch, "--train.micro_batch=8", "--model.norm=sync_batch", "--run.id=synced"])
    _assert_same(synced["state"], single["state"])
    assert_same_training(synced, single, "sync_batch, 2 ranks")
    local = _state(tmp_path, 2, [*batch, "--train.micro_batch=8", "--model.norm=batch", "--run.id=local"])
    with pytest.raises(AssertionError):  # per-rank statistics: the comparison above would catch them
        _assert_same(local, single["state"])
    # 2 pipeline stages × 2 DDP replicas: SyncBatchNorm over the 2 replicas of each stage only; one
    # pipeline micro-batch, so each BatchNorm sees the same 8 + 8 samples as above.
    pipeline = [*batch, "--train.micro_batch=8", "--model.norm=sync_batch", "--run.id=pp"]
    pipeline += ["--parallel.pp=2", "--parallel.pipeline.microbatches=1", "--parallel.pipeline.schedule=gpipe"]
    ranks = run_distributed(resnet_rank, 4, args=(str(tmp_path), pipeline), timeout_s=60)
    stages = {**ranks[0]["state"], **ranks[2]["state"]}  # ranks 0, 1: stage 0; ranks 2, 3: stage 1
    assert "stem.0.weight" not in ranks[2]["state"] and "head.weight" not in ranks[0]["state"]
    _assert_same(stages, single["state"])
    assert_same_training(ranks[0], single, "2 stages × 2 replicas")


def test_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    common = [
        "--model.norm=sync_batch",
        "--train.micro_batch=8",
        "--train.max_steps=6",
        "--checkpoint.every=3",
        "--checkpoint.final=true",
    ]
    full = _state(tmp_path, 2, [*common, "--run.id=full"])
    runs = tmp_path / "runs"
    shutil.copytree(runs / "full", runs / "resumed")  # as if killed right after the step-3 checkpoint
    for checkpoint in list_checkpoints(runs / "resumed")[1:]:
        shutil.rmtree(checkpoint)
    (runs / "resumed" / "metrics.jsonl").unlink()
    resumed = _state(tmp_path, 2, [*common, "--run.id=resumed", "--checkpoint.resume=true"])
    for key, value in full.items():
        assert torch.equal(resumed[key], value), key
    # It really continued from step 3 (a fresh start would end the same: the run is deterministic).
    assert [r["step"] for r in _records(runs / "resumed") if r["kind"] == "train"] == [4, 5, 6]


def test_training_reports_validation_top1(tmp_path: Path) -> None:
    overrides = [
        "--model.width=8",
        "--model.norm=sync_batch",
        "--train.max_steps=60",
        "--train.micro_batch=16",
        "--train.eval_every=30",
        "--train.eval_samples=200",
        "--model.crop_padding=2",  # shifts of up to 1 pixel of the 8×8 original at 16 pixels
        "--optim.lr=1e-2",
        "--optim.warmup_steps=5",
        "--data.val_fraction=0.2",
        "--run.id=top1",
    ]
    run_distributed(resnet_rank, 2, args=(str(tmp_path), overrides), timeout_s=60)
    val = [r for r in _records(tmp_path / "runs" / "top1") if r["kind"] == "val"]
    assert [r["step"] for r in val] == [0, 30, 60]
    assert val[0]["val_top1"] < 0.3, val  # untrained, 10 classes: about chance, 0.1
    assert val[-1]["val_top1"] > 0.6, val
    assert val[-1]["val_loss"] < val[0]["val_loss"]
