"""A NaN loss on one rank: every rank takes the same decision before the optimizer step — abort
(naming the step and the rank) or skip the step together — and too many skips in a row abort."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from support import train_rank
from trainmesh.testing import DistributedTestError, run_distributed
from trainmesh.train.faults import ENV_VAR

pytestmark = pytest.mark.slow

# A short collective timeout: ranks that decided differently wait for each other in mismatched collectives,
# which must fail the test in seconds.
RUN = ["--train.micro_batch=4", "--train.global_batch=8", "--train.max_steps=5", "--dist.timeout_s=8"]


def test_skip_policy_skips_the_step_on_every_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "rank=1,step=3,kind=nan")
    r0, r1 = run_distributed(train_rank, 2, args=(str(tmp_path), [*RUN, "--train.nonfinite=skip", "--run.id=s"]))
    for key, value in r0["params"].items():
        assert torch.isfinite(value).all() and torch.equal(value, r1["params"][key]), key
    records = [json.loads(line) for line in (tmp_path / "runs" / "s" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["skipped_steps"] for r in train] == [0, 0, 1, 1, 1]
    assert all(r["loss"] == r["loss"] for r in train if r["step"] != 3)  # finite apart from the skipped step


def test_abort_policy_names_the_step_and_the_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "rank=1,step=3,kind=nan")
    expected = r"non-finite gradient norm at step 3 \(the loss was non-finite on rank\(s\) \[1\]\)"
    with pytest.raises(DistributedTestError, match=expected):
        run_distributed(train_rank, 2, args=(str(tmp_path), [*RUN, "--train.nonfinite=abort", "--run.id=a"]))
    records = [json.loads(line) for line in (tmp_path / "runs" / "a" / "metrics.jsonl").read_text().splitlines()]
    aborted = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    monkeypatch.delenv(ENV_VAR)
    clean = run_distributed(train_rank, 2, args=(str(tmp_path), [*RUN, "--run.id=c"]))[0]["losses"]
    assert aborted == [(1, clean[0]), (2, clean[1])]  # the steps before it are recorded, with their losses


def test_too_many_skips_in_a_row_abort(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, ";".join(f"rank=0,step={s},kind=nan" for s in (2, 3, 4)))
    overrides = [*RUN, "--train.nonfinite=skip", "--train.max_skipped_steps=2", "--run.id=k"]
    with pytest.raises(DistributedTestError, match=r"3 steps in a row were skipped"):
        run_distributed(train_rank, 2, args=(str(tmp_path), overrides))
