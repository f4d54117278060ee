"""PowerSGD compression (parallel.ddp.comm_hook = "powersgd") on 2 gloo ranks: exact all-reduces until
powersgd_start_iter, compressed after, replicas kept identical, and a resume that continues its per-rank
state (error feedback, warm-start Qs, iteration, RNG) exactly, although the resumed DDP starts from other
buckets (its initial assignment, rebuilt after one step) than the run had when it saved."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from support import train_rank, train_rank_runs
from trainmesh.testing import run_distributed
from trainmesh.train.faults import ENV_VAR

pytestmark = pytest.mark.timeout(240)

BATCH = ["--train.micro_batch=4", "--train.global_batch=8", "--train.max_steps=8", "--checkpoint.final=true"]
# small buckets: many of them, so the state is spread over several and DDP's rebuild moves parameters between them
POWERSGD = [
    "--parallel.ddp.comm_hook=powersgd",
    "--parallel.ddp.powersgd_start_iter=3",
    "--parallel.ddp.powersgd_rank=2",
    "--parallel.ddp.bucket_cap_mb=0.02",
]


def test_powersgd_compresses_after_its_start_and_resumes_exactly(tmp_path: Path) -> None:
    runs = [
        [*BATCH, "--run.id=plain"],
        [*BATCH, *POWERSGD, "--run.id=whole", "--checkpoint.every=5"],
    ]
    ranks = run_distributed(train_rank_runs, 2, args=(str(tmp_path), runs), timeout_s=120)
    plain, whole = ranks[0]
    # three exact all-reduces: the losses of steps 1-4 are the plain run's; compressed from the 4th update on
    assert whole["losses"][:4] == plain["losses"][:4]
    assert all(a != b for a, b in zip(whole["losses"][4:], plain["losses"][4:], strict=True)), whole["losses"]
    assert whole["losses"][-1] < whole["losses"][0]  # still learns
    for key, value in whole["params"].items():
        assert torch.equal(value, ranks[1][1]["params"][key]), key  # the ranks agree on the compressed average
    for rank in (0, 1):
        state = saved_state(tmp_path / "runs" / "whole", rank)
        assert state["iter"] == 5 and {"error", "q"} <= set(state["params"]["blocks.0.attn.qkv.weight"])

    # as if the job had died right after committing step 5: DDP starts again from its initial buckets
    shutil.copytree(tmp_path / "runs" / "whole", tmp_path / "runs" / "cut")
    shutil.rmtree(tmp_path / "runs" / "cut" / "checkpoints" / "step_00000008")
    resume = [*BATCH, *POWERSGD, "--run.id=cut", "--checkpoint.every=5", "--checkpoint.resume=true"]
    resumed = run_distributed(train_rank, 2, args=(str(tmp_path), resume))[0]
    for key, value in whole["params"].items():
        assert torch.equal(resumed["params"][key], value), key


def saved_state(run_dir: Path, rank: int) -> dict[str, Any]:
    ckpt = run_dir / "checkpoints" / "step_00000005"
    return torch.load(ckpt / "rng" / f"rank_{rank}.pt", weights_only=True)["strategy"]["powersgd"]


def test_a_skipped_non_finite_step_does_not_poison_the_error_feedback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A NaN at step 5 (compressed since step 4) enters PowerSGD's error feedback; skipping the step clears it,
    so the steps after it are finite again (kept, it would add NaN to every later gradient)."""
    monkeypatch.setenv(ENV_VAR, "rank=1,step=5,kind=nan")
    run = [*BATCH, *POWERSGD, "--train.nonfinite=skip", "--run.id=nan"]
    result = run_distributed(train_rank, 2, args=(str(tmp_path), run))[0]
    norms = result["grad_norms"]
    assert norms[4] != norms[4] and all(n == n for i, n in enumerate(norms) if i != 4), norms
    assert all(bool(torch.isfinite(v).all()) for v in result["params"].values())
