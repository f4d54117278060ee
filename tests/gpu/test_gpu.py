"""GPU checks (skipped without CUDA): both recipes in every precision, the fp16 loss scaler, torch.compile,
fused AdamW, TF32, and DDP over NCCL. Run with `make gpu-check` (see docs/gpu.md)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from support import assert_learned, nano_config, train_rank, train_records, val_losses
from trainmesh.checkpoint import list_checkpoints
from trainmesh.config.schema import DistConfig
from trainmesh.core.dist import tf32_note
from trainmesh.job.spec import load_config
from trainmesh.job.worker import run_worker
from trainmesh.metrics.mfu import device_peak
from trainmesh.runtime.runtime import Runtime
from trainmesh.testing import run_distributed
from trainmesh.train.faults import ENV_VAR
from trainmesh.train.optim import build_optimizer

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

NCCL = "--dist.backend=nccl"
PRECISIONS = ["32-true", "bf16-mixed", "16-mixed", "bf16-true"]
RESNET = [
    "--model.width=8",
    "--model.image_size=16",
    "--train.max_steps=30",
    "--train.micro_batch=32",
    "--train.eval_every=0",
    "--train.eval_samples=256",
    "--run.progress=false",
    "--run.log_every=5",
    "--checkpoint.final=false",
    "--optim.warmup_steps=3",
    "--optim.lr=1e-2",
    "--dist.timeout_s=60",
]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_gpt_trains_on_one_gpu(tmp_path: Path, precision: str) -> None:
    overrides = [f"--train.precision={precision}", "--train.max_steps=20", f"--run.id={precision}"]
    run_distributed(train_rank, 1, args=(str(tmp_path), overrides), timeout_s=120)
    assert_learned(tmp_path / "runs" / precision, by=1.0)  # fp32 on CPU: 5.49 -> 4.10 in these 20 steps


def resnet_rank(rank: int, root: str, overrides: list[str]) -> dict[str, Any]:
    config = load_config(None, [*RESNET, f"--run.out_dir={root}/runs", *overrides], "resnet")
    result = run_worker(config, Path(root) / "runs" / config.run.id)
    model = result.model
    return {
        "channels_last": all(
            m.weight.is_contiguous(memory_format=torch.channels_last)
            for m in model.modules()
            if isinstance(m, nn.Conv2d)
        ),
    }


@pytest.mark.parametrize("precision", PRECISIONS)
def test_resnet_trains_on_one_gpu(tmp_path: Path, precision: str) -> None:
    overrides = [f"--train.precision={precision}", f"--run.id={precision}"]
    run_distributed(resnet_rank, 1, args=(str(tmp_path), overrides), timeout_s=120)
    assert_learned(tmp_path / "runs" / precision, by=0.3)  # 32-true on an H100: 2.39 -> 1.89 in these 30 steps


def test_channels_last_resnet_with_sync_batchnorm_over_nccl(tmp_path: Path) -> None:
    """At world size 1 the recipe keeps plain BatchNorm (nothing to synchronise); the synchronised layer
    itself over NCCL is checked against BatchNorm in tests/gpu/test_gpu_layouts.py."""
    overrides = [
        "--model.channels_last=true",
        "--model.norm=sync_batch",
        "--parallel.strategy=ddp",
        "--dist.backend=nccl",
        "--train.precision=bf16-mixed",
        "--run.id=cl",
    ]
    (result,) = run_distributed(resnet_rank, 1, args=(str(tmp_path), overrides), timeout_s=120)
    assert result["channels_last"]
    assert_learned(tmp_path / "runs" / "cl", by=0.3)


def test_fp16_overflow_is_skipped_and_lowers_the_scale(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN loss at step 3 under 16-mixed: the GradScaler skips that step, halves its scale, training goes on."""
    monkeypatch.setenv(ENV_VAR, "rank=0,step=3,kind=nan")
    overrides = ["--train.precision=16-mixed", "--train.max_steps=20", "--checkpoint.final=true", "--run.id=o"]
    run_distributed(train_rank, 1, args=(str(tmp_path), overrides), timeout_s=120)
    run_dir = tmp_path / "runs" / "o"
    assert train_records(run_dir)[-1]["skipped_steps"] == 1
    state = json.loads((list_checkpoints(run_dir)[-1] / "trainer_state.json").read_text())
    assert state["precision"]["scaler"]["scale"] == 2.0**15  # 2**16 at the start, halved once, no growth yet
    assert_learned(run_dir, by=1.0)


def compiled_rank(rank: int, root: str, overrides: list[str]) -> list[str]:
    """The modules that were compiled (nn.Module.compile sets the module's compiled call), by name."""
    config = nano_config(Path(root), *overrides)
    result = run_worker(config, Path(root) / "runs" / config.run.id)
    return [name for name, m in result.model.named_modules() if getattr(m, "_compiled_call_impl", None)]


@pytest.mark.parametrize(
    ("strategy", "compiled"), [("single", [""]), ("ddp", [""]), ("fsdp", ["blocks.0", "blocks.1"])]
)
def test_compile_trains_the_whole_model_or_each_block(tmp_path: Path, strategy: str, compiled: list[str]) -> None:
    """One graph for the whole model where nothing is sharded (under ddp, the module inside the wrapper,
    so that evaluation compiles too); one per block under fsdp."""
    overrides = ["--train.compile=true", "--train.precision=bf16-mixed", "--train.max_steps=20", "--run.id=c"]
    overrides += [f"--parallel.strategy={strategy}", "--dist.backend=auto" if strategy == "single" else NCCL]
    (names,) = run_distributed(compiled_rank, 1, args=(str(tmp_path), overrides), timeout_s=300)
    assert names == compiled
    assert_learned(tmp_path / "runs" / "c", by=1.0)


def test_fused_adamw_on_cuda() -> None:
    config = load_config(None, [], "gpt")
    model = nn.Linear(8, 8, device="cuda")
    assert build_optimizer(model, config.optim, torch.device("cuda")).defaults["fused"] is True
    off = replace(config.optim, fused=False)
    assert not build_optimizer(model, off, torch.device("cuda")).defaults["fused"]


@pytest.mark.parametrize("tf32", [True, False])
def test_tf32_switch(tf32: bool) -> None:
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        rt = Runtime(dist_config=DistConfig(device="cuda"), tf32=tf32)
        assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")
        assert torch.backends.cudnn.allow_tf32 is tf32
        assert str(tf32_note(rt.device)).startswith(f"TF32 matmuls: {'on' if tf32 else 'off'} (train.tf32=")
        peak = device_peak(rt.device, torch.float32, rt.tf32)
        if peak is not None:  # a device in the MFU table: TF32 counts against the tensor-core peak
            assert ("TF32" in peak.describe()) is tf32
        a = torch.randn(512, 512, device="cuda")
        exact = (a.double() @ a.double()).float()
        error = ((a @ a) - exact).abs().max().item()
        assert (error > 1e-3) is tf32, error  # TF32 products carry a 10-bit mantissa
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def test_ddp_over_nccl_matches_single_gpu(tmp_path: Path) -> None:
    """On every visible GPU (with two or more, NCCL really all-reduces between them)."""
    world = torch.cuda.device_count()
    batch = f"--train.global_batch={4 * world}"
    exact = "--train.tf32=false"  # the two runs sum in different orders; TF32 would blur that to 1e-3
    ddp_run = ["--train.micro_batch=4", batch, exact, "--dist.backend=nccl", "--parallel.strategy=ddp", "--run.id=d"]
    ddp = run_distributed(train_rank, world, args=(str(tmp_path), ddp_run), timeout_s=120)
    single = run_distributed(
        train_rank, 1, args=(str(tmp_path), [f"--train.micro_batch={4 * world}", batch, exact, "--run.id=s"])
    )
    for key, value in single[0]["params"].items():
        torch.testing.assert_close(ddp[0]["params"][key], value, atol=1e-5, rtol=1e-4)


def test_bf16_compression_hook_on_nccl(tmp_path: Path) -> None:
    overrides = ["--parallel.strategy=ddp", "--parallel.ddp.comm_hook=bf16", "--train.max_steps=10", "--run.id=h"]
    run_distributed(train_rank, 1, args=(str(tmp_path), overrides), timeout_s=120)
    untrained, *_, trained = val_losses(tmp_path / "runs" / "h")
    assert trained < untrained - 0.5, (untrained, trained)
