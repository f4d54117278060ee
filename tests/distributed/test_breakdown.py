"""The step-time breakdown: every record says where its steps' time went on every rank, names the slowest
rank, and a rank that stays slow is reported as a straggler (the clock itself: tests/unit/test_step_clock.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from support import nano_config
from trainmesh.config import Config
from trainmesh.job.worker import run_worker
from trainmesh.metrics.breakdown import PHASES
from trainmesh.recipes.base import Datasets
from trainmesh.recipes.gpt import GPTRecipe
from trainmesh.runtime.runtime import Runtime
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.slow
DELAY_S = 0.05


class SlowItems(Dataset[Any]):
    """Rank 1's data loads DELAY_S slower per sample: a straggler."""

    def __init__(self, inner: Dataset[Any]) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        time.sleep(DELAY_S)
        return self.inner[index]


class StragglingRecipe(GPTRecipe):
    def prepare(self, config: Config, runtime: Runtime) -> Datasets:
        train, val = super().prepare(config, runtime)
        return Datasets(SlowItems(train) if runtime.rank == 1 else train, val)


def straggler_rank(rank: int, root: str) -> list[dict[str, Any]]:
    overrides = ["--train.max_steps=8", "--run.log_every=2", "--train.micro_batch=2", "--run.id=s"]
    run_worker(nano_config(Path(root), *overrides), Path(root) / "runs" / "s", recipe=StragglingRecipe())
    lines = (Path(root) / "runs" / "s" / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


class SlowBackward(GPTRecipe):
    """Rank 1 starts each backward DELAY_S late: rank 0 has all its gradients and waits for rank 1's."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def output_loss(self, output: Any, targets: Any) -> torch.Tensor:
        loss = super().output_loss(output, targets)
        if self.rank == 1 and loss.requires_grad:  # training, not evaluation
            loss.register_hook(lambda grad: time.sleep(DELAY_S) or grad)
        return loss


def slow_backward_rank(rank: int, root: str) -> list[dict[str, Any]]:
    overrides = ["--train.max_steps=4", "--run.log_every=2", "--run.id=b", "--parallel.strategy=ddp"]
    run_worker(nano_config(Path(root), *overrides), Path(root) / "runs" / "b", recipe=SlowBackward(rank))
    lines = (Path(root) / "runs" / "b" / "metrics.jsonl").read_text().splitlines() if rank == 0 else []
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def test_waiting_for_a_peers_gradients_is_exposed_communication(tmp_path: Path) -> None:
    """Rank 0's backward ends with its last gradient bucket; then it waits DELAY_S for rank 1's, in comm."""
    records, _ = run_distributed(slow_backward_rank, 2, args=(str(tmp_path),), timeout_s=120)
    for r in records:
        assert r["time_comm_ms"] > 0.8 * 1000 * DELAY_S, r
        assert r["time_backward_ms"] < r["time_comm_ms"], r


def test_every_record_has_the_breakdown_and_a_straggler_is_named(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    records, _ = run_distributed(straggler_rank, 2, args=(str(tmp_path),), timeout_s=120)
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    for r in records:
        phases = sum(r[f"time_{p}_ms"] for p in PHASES)
        assert phases == pytest.approx(r["step_time_ms"], rel=0.25), r  # the phases account for the step
        assert r["slowest_rank"] == 1, r  # 2 samples × 50 ms of data per step on rank 1
        # Rank 1 is 100 ms slower per step; a loaded test machine slows rank 0 too, so only a part is asserted.
        assert r["slowest_compute_ms"] - r["median_compute_ms"] > 0.2 * 1000 * DELAY_S, r
        assert r["compute_spread"] > 0.2, r
        assert r["host_rss_gb"] > 0.1, r  # rank 0's host, sampled alongside (CPU % from the 2nd sample on)
    out = capfd.readouterr()
    assert "rank 1 is a straggler" in out.out + out.err
    assert "where the steps' time went on rank 0: data" in out.out + out.err
