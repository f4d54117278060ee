"""A NaN loss on one rank: every rank takes the same decision before the optimizer step — abort
(naming the step and the rank) or skip the step together — and too many skips in a row abort. With the fused AdamW
the decision is taken on the device (no host read in the step) and read back at the logging window: the same
outcome, found at the window."""

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


FUSED = ["--optim.fused=true"]  # decided on the device
TP = ["--parallel.strategy=fsdp", "--parallel.tp=2"]  # one flag for DTensors of a 2-D mesh and plain tensors


@pytest.mark.parametrize(
    "optimizer", [[], FUSED, [*FUSED, *TP], [*FUSED, "--parallel.pp=2"]], ids=["read", "device", "tp", "pp"]
)
def test_skip_policy_skips_the_step_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, optimizer: list[str]
) -> None:
    monkeypatch.setenv(ENV_VAR, "rank=1,step=3,kind=nan")
    overrides = [*RUN, *optimizer, "--train.nonfinite=skip", "--run.id=s"]
    r0, r1 = run_distributed(train_rank, 2, args=(str(tmp_path), overrides))
    for key, value in r0["params"].items():  # a pipeline's ranks hold different stages
        other = r1["params"].get(key, value)
        assert torch.isfinite(value).all() and torch.equal(value, other), key
    assert all(torch.isfinite(value).all() for value in r1["params"].values())
    records = [json.loads(line) for line in (tmp_path / "runs" / "s" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["skipped_steps"] for r in train] == [0, 0, 1, 1, 1]
    assert all(r["loss"] == r["loss"] for r in train if r["step"] != 3)  # finite apart from the skipped step


@pytest.mark.parametrize("optimizer", [[], FUSED], ids=["read-each-step", "on-device"])
def test_abort_policy_names_the_step_and_the_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, optimizer: list[str]
) -> None:
    monkeypatch.setenv(ENV_VAR, "rank=1,step=3,kind=nan")
    expected = r"non-finite gradient norm at step 3 \(the loss was non-finite on rank\(s\) \[1\]\)"
    with pytest.raises(DistributedTestError, match=expected):
        overrides = [*RUN, *optimizer, "--train.nonfinite=abort", "--run.id=a"]
        run_distributed(train_rank, 2, args=(str(tmp_path), overrides))
    records = [json.loads(line) for line in (tmp_path / "runs" / "a" / "metrics.jsonl").read_text().splitlines()]
    aborted = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    monkeypatch.delenv(ENV_VAR)
    clean = run_distributed(train_rank, 2, args=(str(tmp_path), [*RUN, "--run.id=c"]))[0]["losses"]
    assert aborted == [(1, clean[0]), (2, clean[1])]  # the steps before it are recorded, with their losses


@pytest.mark.parametrize("optimizer", [[], FUSED], ids=["read-each-step", "on-device"])
def test_too_many_skips_in_a_row_abort(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, optimizer: list[str]) -> None:
    monkeypatch.setenv(ENV_VAR, ";".join(f"rank=0,step={s},kind=nan" for s in (2, 3, 4)))
    overrides = [*RUN, *optimizer, "--train.nonfinite=skip", "--train.max_skipped_steps=2", "--run.id=k"]
    with pytest.raises(DistributedTestError, match=r"3 steps in a row were skipped"):
        run_distributed(train_rank, 2, args=(str(tmp_path), overrides))


def test_on_the_device_an_abort_is_found_at_the_window_and_names_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Logging every 4 steps, a NaN at step 2 is read back at step 4's window: the run aborts there naming step 2,
    the weights as step 1 left them plus steps 3 and 4 (step 2's update was not taken on either rank)."""
    monkeypatch.setenv(ENV_VAR, "rank=1,step=2,kind=nan")
    overrides = [*RUN, *FUSED, "--run.log_every=4", "--train.nonfinite=abort", "--run.id=w"]
    with pytest.raises(DistributedTestError, match=r"non-finite gradient norm at step 2 .*rank\(s\) \[1\]"):
        run_distributed(train_rank, 2, args=(str(tmp_path), overrides))
    records = (tmp_path / "runs" / "w" / "metrics.jsonl").read_text().splitlines()
    assert not [line for line in records if '"kind": "train"' in line]  # no window completed before it


@pytest.mark.parametrize("optimizer", [[], FUSED], ids=["read", "device"])
def test_on_the_device_the_steps_before_the_window_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, optimizer: list[str]
) -> None:
    """A NaN at step 2 and a fault at the end of step 3, logging every 4 steps: reading the norm in the step aborts
    at step 2; on the device (DDP's fused AdamW here, as on any strategy that needs no word of a skip) step 3 runs
    and its fault fires first."""
    monkeypatch.setenv(ENV_VAR, "rank=1,step=2,kind=nan;rank=0,step=3,kind=exception")
    overrides = [*RUN, *optimizer, "--parallel.strategy=ddp", "--run.log_every=4", "--run.id=f"]
    first = r"injected fault" if optimizer else r"non-finite gradient norm at step 2"
    with pytest.raises(DistributedTestError, match=first):
        run_distributed(train_rank, 2, args=(str(tmp_path), overrides))
