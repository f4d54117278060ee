"""The parity probe and comparison catch real bugs, at the step and parameter where they start: 2 gloo ranks with
a bug planted from step 3 on, against one process without it.

- a wrong gradient average: one parameter's synchronised gradient summed over the ranks instead of averaged
  (on every rank, so the replicas agree with each other and only the comparison with 1 process shows it), and the
  same on one rank only (the replicas drift apart: the run disagrees with itself);
- a per-rank data bug: rank 1 reads rank 0's samples.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from support import nano_config
from trainmesh.apps.parity.compare import compare, read_record
from trainmesh.data.sharding import GlobalBatchSampler
from trainmesh.job.worker import run_worker
from trainmesh.runtime.runtime import Runtime
from trainmesh.testing import run_distributed
from trainmesh.train import loop
from trainmesh.train.parity import ENV_VAR, NUDGE_VAR

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

BUG_STEP = 3
PARAM = "blocks.1.mlp.fc.weight"
SETTINGS = ["--train.global_batch=8", "--train.max_steps=4"]
BUGS = {"average": "average", "one-rank": "average on rank 1", "data": "data"}  # run name: its bug


def _plant(bug: str, rank: int) -> None:
    """Monkeypatch this rank's process (a fresh one per run_distributed call) with `bug` from BUG_STEP on."""
    step = {"now": 0}
    train_step = loop.train_step

    def counting(session: Any, n: int, *args: Any) -> Any:
        step["now"] = n
        return train_step(session, n, *args)

    loop.train_step = counting  # type: ignore[assignment]
    if bug in ("average", "average on rank 1"):
        clip = Runtime.clip_grad_norm

        def summed(self: Runtime, model: torch.nn.Module, optimizer: Any, max_norm: float) -> torch.Tensor:
            if step["now"] >= BUG_STEP and (bug == "average" or rank == 1):
                grad = dict(self.unwrap(model).named_parameters())[PARAM].grad
                assert grad is not None
                grad.mul_(self.dp_size)  # the ranks' sum, not their mean
            return clip(self, model, optimizer, max_norm)

        Runtime.clip_grad_norm = summed  # type: ignore[method-assign]
    elif bug == "data":
        micro_batches = GlobalBatchSampler.micro_batches

        def rank_0s(self: GlobalBatchSampler, n: int) -> list[list[int]]:
            if self.dp_rank == 1 and n + 1 >= BUG_STEP:  # n counts steps from 0
                self.dp_rank = 0
                try:
                    return micro_batches(self, n)
                finally:
                    self.dp_rank = 1
            return micro_batches(self, n)

        GlobalBatchSampler.micro_batches = rank_0s  # type: ignore[method-assign]


def probe_rank(rank: int, root: str, name: str, bug: str) -> None:
    _plant(bug, rank)
    record = Path(root) / f"{name}.jsonl"
    os.environ[ENV_VAR] = str(record)
    os.environ[NUDGE_VAR] = "1" if name.endswith("-again") else "0"  # as the command runs B again
    config = nano_config(Path(root), *SETTINGS, f"--run.id={name}")
    run_worker(config, Path(root) / "runs" / name)


def _records(root: Path, world: int, runs: list[tuple[str, str]]) -> None:
    for name, bug in runs:  # one spawn per run: each monkeypatches its own processes
        run_distributed(probe_rank, world, args=(str(root), name, bug), timeout_s=60)


def test_a_wrong_gradient_average_and_a_data_bug_are_caught_where_they_start(tmp_path: Path) -> None:
    _records(tmp_path, 1, [("reference", "")])
    runs = [(name, bug) for name, bug in BUGS.items()] + [(f"{name}-again", BUGS[name]) for name in ("average", "data")]
    _records(tmp_path, 2, runs)
    read = {name: read_record(tmp_path / f"{name}.jsonl") for name in ["reference", *(n for n, _ in runs)]}
    reference = read["reference"]
    assert reference.order[:3] == ["wte.weight", "wpe.weight", "blocks.0.ln_1.weight"]  # execution, not name order

    average = compare(reference, read["average"], read["average-again"])
    first = average.first
    assert first is not None and average.first_param is first
    assert (first.step, first.what, first.param) == (BUG_STEP, "gradient", PARAM)
    assert first.difference == pytest.approx(0.5, rel=1e-3)  # twice the gradient: |a - 2a| / 2a
    assert average.widest_spread is not None and first.tolerance < 1e-3  # the nudged repeat moved, a little
    assert [r.over for r in average.rows][:BUG_STEP] == [0] * BUG_STEP  # equal before the bug

    one_rank = compare(reference, read["one-rank"], read["one-rank"])
    first = one_rank.first
    assert first is not None
    assert (first.step, first.what, first.param, first.checksum, first.rank) == (
        BUG_STEP,
        "gradient",
        PARAM,
        "replicas",
        1,
    )

    data = compare(reference, read["data"], read["data-again"])
    first, param = data.first, data.first_param
    assert first is not None and param is not None
    assert (first.step, first.what) == (BUG_STEP, "loss")
    assert (param.step, param.what, param.param) == (BUG_STEP, "gradient", "wte.weight")  # the first used
