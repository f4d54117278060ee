"""Data parallel equals one process: DDP on 2 gloo ranks with micro-batch b, one process with batch 2b,
and one process with batch b and 2 accumulation steps reach the same parameters after several AdamW
steps (fp32). Also with micro-batches whose target counts differ (ignore_index padding), where a
per-micro-batch mean would be wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support import train_rank
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.slow

# Reduction order differs (two-way all-reduce vs one batched sum), so equality holds to fp32 rounding,
# amplified a little by Adam's normalisation over 4 steps; observed max |diff| is ~1e-6.
ATOL, RTOL = 2e-5, 1e-4

SETUPS = {
    "single, batch 2b": (1, ["--train.micro_batch=8", "--train.global_batch=8", "--parallel.strategy=single"]),
    "single, b × 2 accumulation": (1, ["--train.micro_batch=4", "--train.global_batch=8"]),
    "ddp 2 ranks, micro b": (2, ["--train.micro_batch=4", "--train.global_batch=8", "--parallel.strategy=ddp"]),
    "ddp 2 ranks, b/2 × 2 accumulation": (
        2,
        ["--train.micro_batch=2", "--train.global_batch=8", "--parallel.strategy=ddp"],
    ),
}


def _train_all(root: Path, padded: bool) -> dict[str, dict[str, torch.Tensor]]:
    params = {}
    for i, (name, (world, overrides)) in enumerate(SETUPS.items()):
        results = run_distributed(train_rank, world, args=(str(root), [*overrides, f"--run.name=p{i}"], padded))
        if world > 1:  # DDP keeps replicas identical
            for a, b in zip(results[0]["params"].values(), results[1]["params"].values(), strict=True):
                assert torch.equal(a, b)
        params[name] = results[0]["params"]
    return params


def _assert_same(params: dict[str, dict[str, torch.Tensor]]) -> None:
    reference_name, reference = next(iter(params.items()))
    for name, weights in params.items():
        for key, ref in reference.items():
            torch.testing.assert_close(
                weights[key], ref, atol=ATOL, rtol=RTOL, msg=f"{name} vs {reference_name}: {key}"
            )


@pytest.mark.timeout(240)
def test_ddp_equals_single_and_accumulation(tmp_path: Path) -> None:
    _assert_same(_train_all(tmp_path, padded=False))


@pytest.mark.timeout(240)
def test_parity_holds_with_uneven_target_counts(tmp_path: Path) -> None:
    _assert_same(_train_all(tmp_path, padded=True))
