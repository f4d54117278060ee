"""Every data-parallel layout on one GPU over NCCL (world size 1), launched two ways: through the real
command line (`trainmesh run`, which starts torchrun) and in this very process (no launcher, the
environment set by hand); plus SyncBatchNorm's NCCL path and an exact resume from an async save."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from support import assert_learned, nano_config, nano_toml, train_rank
from trainmesh.checkpoint import list_checkpoints
from trainmesh.core.env import free_port
from trainmesh.job.worker import run_worker
from trainmesh.layers import SyncBatchNorm
from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

BIN = Path(sys.executable).parent
NCCL = "--dist.backend=nccl"
LAYOUTS = {
    "ddp": ["--parallel.strategy=ddp", NCCL],
    "fsdp": ["--parallel.strategy=fsdp", NCCL],
    "fsdp-cpu-offload": ["--parallel.strategy=fsdp", "--parallel.fsdp.cpu_offload=true", NCCL],
    "fsdp-meta-init": ["--parallel.strategy=fsdp", "--parallel.meta_init=true", NCCL],
    "ddp-activation-checkpointing": ["--parallel.strategy=ddp", "--parallel.activation_checkpointing=1", NCCL],
    "dp": ["--parallel.strategy=dp"],  # one process driving the visible GPUs: no process group
}
STEPS = ["--train.max_steps=20", "--train.precision=bf16-mixed"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_under_trainmesh_run(tmp_path: Path, layout: str) -> None:
    cmd = [str(BIN / "trainmesh"), "run", "gpt", "--config", str(nano_toml(tmp_path)), "--nproc-per-node", "1"]
    cmd += [*LAYOUTS[layout], *STEPS, f"--run.id={layout}"]
    env = {**os.environ, "OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert_learned(tmp_path / "runs" / layout, by=1.0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_in_process(tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a notebook or a plain `python train.py` does: rank 0 of 1, in the caller's own process."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for key, value in {**env, "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    config = nano_config(tmp_path, *LAYOUTS[layout], *STEPS, f"--run.id={layout}")
    result = run_worker(config, tmp_path / "runs" / layout)
    assert not torch.distributed.is_initialized()  # torn down: the next test may start its own group
    assert result.steps == 20
    assert_learned(tmp_path / "runs" / layout, by=1.0)


def _sync_batchnorm_rank(rank: int) -> None:
    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", 0))
    try:
        torch.manual_seed(0)
        x = torch.randn(8, 16, 12, 12, device="cuda").contiguous(memory_format=torch.channels_last)
        plain, synced = nn.BatchNorm2d(16).cuda(), SyncBatchNorm(16).cuda()
        outputs, grads = [], []
        for layer in (plain, synced):
            xi = x.clone().requires_grad_(True)
            y = layer(xi)
            (y * torch.arange(y.numel(), device="cuda").view_as(y).sin()).sum().backward()
            outputs.append(y)
            assert xi.grad is not None
            grads.append(xi.grad)
        torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(synced.running_var, plain.running_var)
    finally:
        torch.distributed.destroy_process_group()


def test_sync_batchnorm_over_nccl_equals_batchnorm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The synchronised path itself (all-reduce of fp64 statistics over NCCL and its backward) on a
    channels-last input: with one rank it must give what BatchNorm gives."""
    monkeypatch.setattr(SyncBatchNorm, "_group_size", lambda self: 2)  # take the synced path at world size 1
    run_distributed(_sync_batchnorm_rank, 1)


def test_async_checkpoint_from_gpu_resumes_exactly(tmp_path: Path) -> None:
    """Background saves from device memory at steps 5 and 10; a copy of the run without the step-10
    checkpoint (a job killed after step 5) resumes to the same weights bit for bit (deterministic kernels,
    full fp32, dropout on so the RNG state matters)."""
    common = [*LAYOUTS["ddp"], "--run.deterministic=true", "--train.tf32=false", "--checkpoint.async_save=true"]
    common += ["--train.max_steps=10", "--checkpoint.every=5", "--checkpoint.final=true", "--model.dropout=0.1"]
    whole = run_distributed(train_rank, 1, args=(str(tmp_path), [*common, "--run.id=whole"]), timeout_s=120)
    shutil.copytree(tmp_path / "runs" / "whole", tmp_path / "runs" / "cut")
    shutil.rmtree(list_checkpoints(tmp_path / "runs" / "cut")[-1])
    assert [p.name for p in list_checkpoints(tmp_path / "runs" / "cut")] == ["step_00000005"]
    resume = [*common, "--run.id=cut", "--checkpoint.resume=true"]
    resumed = run_distributed(train_rank, 1, args=(str(tmp_path), resume), timeout_s=120)
    for key, value in whole[0]["params"].items():
        assert torch.equal(resumed[0]["params"][key], value), key
