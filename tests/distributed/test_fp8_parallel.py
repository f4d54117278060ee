"""fp8-mixed across 2 gloo ranks, with torchao's float8 emulation (the same float8 roundings, computed in high
precision; the fp8 tensor cores are tested in tests/gpu): fsdp with and without float8 all-gather and a pipeline
train like one process, float8 all-gather really gathers torchao's float8 weights with the scales precomputed
after each optimizer step, and its sharded checkpoint resumes in one bf16-mixed process."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor
from torchao.float8.float8_linear import Float8Linear

from support import nano_config, train_rank_runs, train_records
from trainmesh.checkpoint import list_checkpoints, read_full_state
from trainmesh.job.worker import run_worker
from trainmesh.testing import run_distributed
from trainmesh.train.loop import TrainResult

pytestmark = pytest.mark.slow

FP8 = ["--train.precision=fp8-mixed", "--float8.emulate=true", "--train.max_steps=6", "--train.global_batch=8"]
FSDP = [*FP8, "--parallel.strategy=fsdp", "--train.micro_batch=4"]
ALL_GATHER = [*FSDP, "--float8.fsdp_all_gather=true", "--checkpoint.final=true", "--run.id=gather"]
# One process against two: the same float8 casts of each micro-batch (a rank's micro-batch is one of the single
# process's accumulation steps), but gradients reduced in another order and, with float8 all-gather, weights cast
# to float8 from their fp32 shards instead of from bf16 copies: close, not equal.
REL = 2e-3


def _gather_rank(rank: int, root: str) -> dict[str, Any]:
    """The all-gather run; what each Float8Linear's weight is, and its precomputed scale against the scale of the
    final weights (the optimizer step's precompute ran after the last step)."""
    config = nano_config(Path(root), *ALL_GATHER)
    found: dict[str, Any] = {"weights": set(), "scale_errors": []}

    def inspect(result: TrainResult) -> None:  # while the group exists: full_tensor() is collective
        for module in result.model.modules():
            if not isinstance(module, Float8Linear):
                continue
            weight = module.weight
            assert isinstance(weight, DTensor)
            local = weight._local_tensor  # to_local() would give a view, without the precomputed scale
            found["weights"].add(type(local).__name__)
            amax = weight.full_tensor().abs().max().double().clamp(min=1e-12)
            expected = (torch.finfo(torch.float8_e4m3fn).max / amax).float()
            found["scale_errors"].append(float((local._precomputed_scale - expected).abs() / expected))

    run_dir = Path(root) / "runs" / config.run.id
    run_worker(config, run_dir, before_teardown=inspect)
    losses = [r["loss"] for r in train_records(run_dir)] if rank == 0 else []  # rank 0 writes the metrics
    return {"weights": sorted(found["weights"]), "scale_errors": found["scale_errors"], "losses": losses}


def test_fsdp_and_pipeline_train_fp8_like_one_process(tmp_path: Path) -> None:
    root = str(tmp_path)
    plain, pipeline = run_distributed(
        train_rank_runs,
        2,
        args=(root, [[*FSDP, "--run.id=fsdp"], [*FP8, "--parallel.pp=2", "--train.micro_batch=8", "--run.id=pp"]]),
        timeout_s=240,
    )[0]
    gather = run_distributed(_gather_rank, 2, args=(root,), timeout_s=240)
    resume = ["--train.precision=bf16-mixed", "--train.global_batch=8", "--train.micro_batch=8"]
    resume += ["--train.max_steps=8", "--checkpoint.resume=true", "--run.id=gather"]
    single, resumed = run_distributed(
        train_rank_runs, 1, args=(root, [[*FP8, "--train.micro_batch=8", "--run.id=single"], resume]), timeout_s=240
    )[0]

    assert "blocks.0.attn.qkv.weight" in plain["sharded"]
    for name, losses in (
        ("fsdp", plain["losses"]),
        ("pipeline", pipeline["losses"]),
        ("all-gather", gather[0]["losses"]),
    ):
        assert losses == pytest.approx(single["losses"], rel=REL), name
    assert single["losses"][-1] < single["losses"][0] - 1.0
    for rank in gather:  # every Float8Linear weight is a shard of torchao's float8-all-gather tensor
        assert rank["weights"] == ["WeightWithDynamicFloat8CastTensor"]
        assert len(rank["scale_errors"]) == 8 and max(rank["scale_errors"]) < 1e-6
    # The all-gather run's step-6 checkpoint (DCP shards of those weights) reads back as plain fp32 tensors under the
    # GPT's own names (what `trainmesh ckpt export` writes), and resumes in one bf16-mixed process.
    whole = read_full_state(list_checkpoints(tmp_path / "runs" / "gather")[0])["model"]
    assert set(whole) == set(single["params"]) and all(type(v) is torch.Tensor for v in whole.values())
    assert {v.dtype for v in whole.values()} == {torch.float32}
    # (metrics.jsonl is appended to: the first 6 records are the all-gather run's)
    assert resumed["losses"][:6] == gather[0]["losses"] and len(resumed["losses"]) == 8
    assert all(math.isfinite(x) and x < single["losses"][0] - 1.0 for x in resumed["losses"][6:])  # trained weights
