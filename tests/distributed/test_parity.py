"""Data parallel equals one process: DDP on 2 gloo ranks with micro-batch b, one process with batch 2b,
and one process with batch b and 2 accumulation steps reach the same parameters after several AdamW
steps (fp32), with the same loss and gradient norm at every step. Also with micro-batches whose target
counts differ (ignore_index padding), where a per-micro-batch mean would be wrong, and without gradient
clipping (where AdamW's update hides a gradient's scale even more: only its norm shows it), and with the head fused
with the loss in chunks (model.loss_chunk_tokens) under DDP and FSDP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from support import assert_same_training, train_rank_runs
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.slow

# Reduction order differs (two-way all-reduce vs one batched sum), so equality holds to fp32 rounding,
# amplified a little by Adam's normalisation over 4 steps; observed max |diff| is ~1e-6.
ATOL, RTOL = 2e-5, 1e-4
# The fused head sums its weight's gradient chunk by chunk, another order: the losses and norms still agree to 1e-7,
# and Adam's normalisation takes near-zero gradients' rounding to ~2.4e-5 in the weights after 4 steps.
CHUNKED_ATOL = 1e-4
BATCH = ["--train.global_batch=8"]
NO_CLIP = "--train.grad_clip=0"
CHUNKED, FSDP = "--model.loss_chunk_tokens=24", "--parallel.strategy=fsdp"

SETUPS: dict[str, tuple[int, list[str]]] = {  # name: (world size, overrides); the first is the reference
    "single, batch 2b": (1, [*BATCH, "--train.micro_batch=8", "--parallel.strategy=single"]),
    "single, b × 2 accumulation": (1, [*BATCH, "--train.micro_batch=4"]),
    "ddp 2 ranks, micro b": (2, [*BATCH, "--train.micro_batch=4", "--parallel.strategy=ddp"]),
    "ddp 2 ranks, b/2 × 2 accumulation": (2, [*BATCH, "--train.micro_batch=2", "--parallel.strategy=ddp"]),
    "single, batch 2b, no clipping": (1, [*BATCH, "--train.micro_batch=8", NO_CLIP]),
    "ddp 2 ranks, b/2 × 2 accumulation, no clipping": (2, [*BATCH, "--train.micro_batch=2", NO_CLIP]),
    # the head fused with the loss, 24 tokens at a time (model.loss_chunk_tokens; a micro-batch of 2 holds 64)
    "ddp 2 ranks, b/2 × 2 accumulation, head in chunks": (2, [*BATCH, "--train.micro_batch=2", CHUNKED]),
    "fsdp 2 ranks, micro b, head in chunks": (2, [*BATCH, "--train.micro_batch=4", FSDP, CHUNKED]),
}


def _train_all(root: Path, padded: bool) -> dict[str, dict[str, Any]]:
    """Every setup, one process start per world size (train_rank_runs)."""
    results: dict[str, dict[str, Any]] = {}
    for world in (1, 2):
        names = [name for name, (w, _) in SETUPS.items() if w == world]
        runs = [[*SETUPS[name][1], f"--run.id={world}-{i}"] for i, name in enumerate(names)]
        per_rank = run_distributed(train_rank_runs, world, args=(str(root), runs, padded), timeout_s=60)
        for i, name in enumerate(names):
            if world > 1:  # DDP keeps replicas identical
                for a, b in zip(per_rank[0][i]["params"].values(), per_rank[1][i]["params"].values(), strict=True):
                    assert torch.equal(a, b), name
            results[name] = per_rank[0][i]
    return results


def _assert_same(results: dict[str, dict[str, Any]]) -> None:
    for clipped in (True, False):
        group = {name: r for name, r in results.items() if ("no clipping" not in name) == clipped}
        reference_name, reference = next(iter(group.items()))
        for name, result in group.items():
            atol = CHUNKED_ATOL if "head in chunks" in name else ATOL
            for key, ref in reference["params"].items():
                torch.testing.assert_close(
                    result["params"][key], ref, atol=atol, rtol=RTOL, msg=f"{name} vs {reference_name}: {key}"
                )
            assert_same_training(result, reference, f"{name} vs {reference_name}")
    clipped, unclipped = results["single, batch 2b"], results["single, batch 2b, no clipping"]
    assert clipped["grad_norms"][0] > 1.0, "clipping must be active for the clipped setups to mean anything"
    assert not torch.equal(clipped["params"]["wte.weight"], unclipped["params"]["wte.weight"])


def test_ddp_equals_single_and_accumulation(tmp_path: Path) -> None:
    _assert_same(_train_all(tmp_path, padded=False))


def test_parity_holds_with_uneven_target_counts(tmp_path: Path) -> None:
    _assert_same(_train_all(tmp_path, padded=True))
