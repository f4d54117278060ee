"""FSDP (FSDP2 `fully_shard`) equals one process: full shard, shard-grad-op, hybrid sharding, CPU
offload and gradient accumulation reach the parameters of a single process with the same global batch
after several AdamW steps (fp32); activation checkpointing changes nothing; and checkpoints move
between fsdp, ddp and a single process (DCP reshards)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from support import assert_same_training, train_rank, train_rank_runs
from trainmesh.checkpoint import read_full_state
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.slow

# As in test_parity: a different reduction order (reduce-scatter vs one batched sum) changes rounding,
# which Adam amplifies a little over 4 steps.
ATOL, RTOL = 2e-5, 1e-4
BATCH = ["--train.global_batch=8", "--model.dropout=0.0"]
FSDP = "--parallel.strategy=fsdp"
AC = "parallel.activation_checkpointing"

NO_CLIP = "--train.grad_clip=0"
SETUPS: dict[str, tuple[int, list[str], str]] = {  # name: (world size, overrides, which reference)
    "fsdp full shard, 2 ranks": (2, [FSDP, "--train.micro_batch=4"], "plain"),
    "fsdp shard-grad-op (ZeRO-2), 2 ranks": (
        2,
        [FSDP, "--train.micro_batch=4", "--parallel.fsdp.reshard_after_forward=false"],
        "plain",
    ),
    "fsdp b/2 × 2 accumulation (no_sync)": (2, [FSDP, "--train.micro_batch=2"], "plain"),
    "fsdp b/2 × 2 accumulation, reduce-scatter every micro-step": (
        2,
        [FSDP, "--train.micro_batch=2", "--parallel.fsdp.reduce_every_microstep=true"],
        "plain",
    ),
    "fsdp hybrid 2 × 2, b/4 × 2, reduce-scatter every micro-step": (
        4,
        [FSDP, "--train.micro_batch=1", "--parallel.dp_replicate=2", "--parallel.fsdp.reduce_every_microstep=true"],
        "plain",
    ),
    "fsdp cpu offload, 2 ranks": (2, [FSDP, "--train.micro_batch=4", "--parallel.fsdp.cpu_offload=true"], "plain"),
    "fsdp hybrid 2 × 2, 4 ranks": (4, [FSDP, "--train.micro_batch=2", "--parallel.dp_replicate=2"], "plain"),
    "fsdp no prefetch, every block recomputed": (
        2,
        [FSDP, "--train.micro_batch=4", "--parallel.fsdp.prefetch=0", "--parallel.activation_checkpointing=1"],
        "plain",
    ),
    "fsdp b/2 × 2, no clipping": (2, [FSDP, "--train.micro_batch=2", NO_CLIP], "no clipping"),
    "fsdp b/2 × 2, uneven target counts": (2, [FSDP, "--train.micro_batch=2"], "uneven target counts"),
}
REFERENCES = {"plain": [], "no clipping": [NO_CLIP], "uneven target counts": []}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """One process, batch 2b, for each kind of setup (uneven: with ignore_index padding)."""
    root = tmp_path_factory.mktemp("fsdp-ref")
    base = [*BATCH, "--train.micro_batch=8", "--parallel.strategy=single"]
    plain = [[*base, *extra, f"--run.id=ref{i}"] for i, extra in enumerate(REFERENCES.values())]
    (results,) = run_distributed(train_rank_runs, 1, args=(str(root), plain[:2]))
    (uneven,) = run_distributed(train_rank_runs, 1, args=(str(root), plain[2:], True))
    return dict(zip(REFERENCES, [*results, *uneven], strict=True))


def _assert_close(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], what: str) -> None:
    assert params.keys() == reference.keys(), what
    for key, ref in reference.items():
        torch.testing.assert_close(params[key], ref, atol=ATOL, rtol=RTOL, msg=f"{what}: {key}")


@pytest.mark.parametrize("name", list(SETUPS))
def test_fsdp_equals_one_process(name: str, references: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    world, overrides, kind = SETUPS[name]
    padded = kind == "uneven target counts"
    results = run_distributed(train_rank, world, args=(str(tmp_path), [*BATCH, *overrides, "--run.id=f"], padded))
    reference = references[kind]
    for result in results:  # every rank gathers the same full parameters
        _assert_close(result["params"], reference["params"], name)
        assert "blocks.0.attn.qkv.weight" in result["sharded"] and "wte.weight" in result["sharded"]
    assert_same_training(results[0], reference, name)


def test_activation_checkpointing_is_exact_with_dropout(tmp_path: Path) -> None:
    """Recomputation replays the same dropout masks (the RNG state is restored): bit-identical."""
    base = ["--train.micro_batch=4", "--train.global_batch=8", "--model.dropout=0.2"]
    plain, recomputed = (
        run_distributed(train_rank, 1, args=(str(tmp_path), [*base, f"--run.id=ac{k}", f"--{AC}={k}"]))[0]
        for k in (0, 1)
    )
    for key, value in plain["params"].items():
        assert torch.equal(recomputed["params"][key], value), key


def test_checkpoints_move_between_fsdp_ddp_and_one_process(tmp_path: Path) -> None:
    """fsdp (2 ranks) saves at step 2 -> one process resumes; ddp saves -> fsdp resumes: each
    continuation matches the uninterrupted fsdp / ddp run. A sharded checkpoint also reads back whole
    in one process without a process group (what `trainmesh ckpt export` does)."""
    steps = ["--train.max_steps=4", "--checkpoint.every=2", "--train.micro_batch=4", *BATCH]
    full = [*steps, FSDP, "--run.id=fsdp-full", "--checkpoint.final=true"]
    fsdp_full = run_distributed(train_rank, 2, args=(str(tmp_path), full))[0]
    whole = read_full_state(tmp_path / "runs" / "fsdp-full" / "checkpoints" / "step_00000004")["model"]
    assert all(torch.equal(whole[k], v) for k, v in fsdp_full["params"].items())
    first = [*steps[1:], FSDP, "--run.id=fsdp-then-single", "--train.max_steps=2"]
    run_distributed(train_rank, 2, args=(str(tmp_path), first))
    resumed = [*steps, "--run.id=fsdp-then-single", "--checkpoint.resume=true", "--train.micro_batch=8"]
    single = run_distributed(train_rank, 1, args=(str(tmp_path), [*resumed, "--parallel.strategy=single"]))[0]
    _assert_close(single["params"], fsdp_full["params"], "fsdp 2 ranks -> single")

    ddp_full = run_distributed(train_rank, 2, args=(str(tmp_path), [*steps, "--run.id=ddp-full"]))[0]
    first = [*steps[1:], "--run.id=ddp-then-fsdp", "--train.max_steps=2"]
    run_distributed(train_rank, 2, args=(str(tmp_path), first))
    then = [*steps, FSDP, "--run.id=ddp-then-fsdp", "--checkpoint.resume=true"]
    fsdp = run_distributed(train_rank, 2, args=(str(tmp_path), then))[0]
    _assert_close(fsdp["params"], ddp_full["params"], "ddp -> fsdp")
