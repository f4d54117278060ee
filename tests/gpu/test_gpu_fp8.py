"""fp8-mixed on a real GPU (skipped without CUDA): float8 tensor cores through torchao, against bf16-mixed from the
same seed on one GPU and under fsdp with float8 all-gather over NCCL (eager and compiled); a GPU without float8
tensor cores (compute capability below 8.9) must refuse it, naming itself. Run with `make gpu-check`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from support import train_rank_runs
from trainmesh.config.schema import DistConfig
from trainmesh.precision.fp8 import FP8_MIN_CAPABILITY
from trainmesh.runtime.runtime import Runtime
from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

# The tiny GPT (128 wide: every block's linear layers are float8-eligible) for 30 steps; 1024 tokens per micro-batch.
STEPS = ["--model.size=tiny", "--model.block_size=128", "--train.micro_batch=8", "--train.max_steps=30"]
STEPS += ["--optim.lr=3e-3", "--optim.warmup_steps=5", "--run.log_every=5"]
BF16, FP8 = "--train.precision=bf16-mixed", "--train.precision=fp8-mixed"
REL = 0.03  # float8's 3 mantissa bits: the logged losses stay within 3% of bf16's


def _has_float8_tensor_cores() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= FP8_MIN_CAPABILITY


def _losses(results: list[dict[str, Any]]) -> list[list[float]]:
    return [r["losses"] for r in results]


def test_a_gpu_without_float8_tensor_cores_refuses_fp8_naming_itself() -> None:
    if _has_float8_tensor_cores():
        pytest.skip(f"{torch.cuda.get_device_name()} has float8 tensor cores")
    with pytest.raises(ValueError) as refused:
        Runtime(precision="fp8-mixed", dist_config=DistConfig(device="cuda"))
    major, minor = torch.cuda.get_device_capability()
    assert f"{torch.cuda.get_device_name()} has compute capability {major}.{minor}" in str(refused.value)


@pytest.mark.skipif(not _has_float8_tensor_cores(), reason="needs compute capability 8.9+ (float8 tensor cores)")
def test_fp8_tracks_bf16_on_one_gpu(tmp_path: Path) -> None:
    runs = [[*STEPS, BF16, "--run.id=bf16"], [*STEPS, FP8, "--run.id=fp8"]]
    (results,) = run_distributed(train_rank_runs, 1, args=(str(tmp_path), runs), timeout_s=300)
    bf16, fp8 = _losses(results)
    assert fp8 == pytest.approx(bf16, rel=REL)
    assert fp8[-1] < fp8[0] - 0.5


@pytest.mark.skipif(not _has_float8_tensor_cores(), reason="needs compute capability 8.9+ (float8 tensor cores)")
@pytest.mark.parametrize("compile", [False, True])
def test_fp8_under_fsdp_with_float8_all_gather_tracks_bf16(tmp_path: Path, compile: bool) -> None:
    """On every visible GPU (one: FSDP still shards over a mesh of one and all-gathers through NCCL)."""
    world = torch.cuda.device_count()
    fsdp = ["--parallel.strategy=fsdp", "--dist.backend=nccl", f"--train.compile={str(compile).lower()}"]
    gather = [FP8, "--float8.fsdp_all_gather=true"]
    runs = [[*STEPS, *fsdp, BF16, "--run.id=bf16"], [*STEPS, *fsdp, *gather, "--run.id=fp8"]]
    results = run_distributed(train_rank_runs, world, args=(str(tmp_path), runs), timeout_s=600)
    bf16, fp8 = _losses(results[0])
    assert "blocks.0.mlp.fc.weight" in results[0][1]["sharded"] or world == 1
    assert fp8 == pytest.approx(bf16, rel=REL)
    assert fp8[-1] < fp8[0] - 0.5
